"""The Ray application's arguments and its config file (docs/ray-serve.yaml), without starting Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("ray.serve")

from pagegate.deploy.ray import PagegateArgs, app, build  # noqa: E402

CONFIG_EXAMPLE = Path(__file__).parent.parent.parent / "docs/ray-serve.yaml"


def test_config_file_example_builds() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG_EXAMPLE.read_text()))
    (application,) = config.applications
    assert application.import_path == "pagegate.deploy.ray:app"
    args: dict[str, Any] = application.args
    assert PagegateArgs.model_validate(args).engine_argv() == [
        "--kv-cache-memory", "2GiB", "--max-num-seqs", "64", "--enable-prefix-caching"]
    app(args)  # Serve's builder accepts it


def test_engine_args_forms() -> None:
    assert PagegateArgs(engine_args="--kv-cache-memory 64MiB --seed 3").engine_argv() == [
        "--kv-cache-memory", "64MiB", "--seed", "3"]
    assert PagegateArgs(engine_args={"enable_prefix_caching": False, "served-model-name": ["a", "b"]}).engine_argv() == [
        "--no-enable-prefix-caching", "--served-model-name", "a", "b"]
    with pytest.raises(ValueError, match="invalid engine_args"):
        build(PagegateArgs(engine_args=["--no-such-flag"]))


def test_serve_run_key_value_arguments() -> None:
    """`serve run pagegate.deploy.ray:app num_replicas=2 engine_args="..."` hands the builder strings."""
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary  # what `serve run` calls

    given = {"num_replicas": "2", "engine_args": "--kv-cache-memory 64MiB"}
    assert isinstance(call_user_app_builder_with_args_if_necessary(app, given), Application)
    args = PagegateArgs.model_validate(given)
    assert (args.num_replicas, args.engine_argv()) == (2, ["--kv-cache-memory", "64MiB"])
