"""lm-evaluation-harness through `pagegate serve` against lm-eval's own transformers backend, same model, same task.

    python -m bench.lm_eval_match [--model FOLDER|GGUF] [--items 300]

`lm_eval --model local-completions` scores every choice of a multiple-choice task by sending token-id prompts with
`echo: true, logprobs: 1, max_tokens: 1` and reading the prompt's logprobs back; `--model hf` runs the forward
itself. The task is written locally (no dataset hub): sums of two digits with four candidate answers. A GGUF model is
first dequantized to a float32 Hugging Face folder (transformers reads GGUF), so both sides run the same weights
in float32 and should agree item by item.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pagegate.testing.launcher import ServerProcess

SMOLLM2 = Path(__file__).resolve().parents[1] / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
TASK = "pagegate_sums"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_task(folder: Path, items: int, seed: int = 0) -> Path:
    """A multiple-choice task of `items` sums (the right answer among three near misses) in `folder`."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for _ in range(items):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        wrong = rng.sample([n for n in range(1, 20) if n != a + b], 3)
        choices = [a + b, *wrong]
        rng.shuffle(choices)
        rows.append({"question": f"Question: What is {a} plus {b}?\nAnswer:",
                     "choices": [str(c) for c in choices], "answer": choices.index(a + b)})
    data = folder / "sums.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data.resolve()))
    return folder


def hf_folder(model: Path, cache: Path) -> Path:
    """`model` itself when it is a folder; a GGUF file dequantized to float32 safetensors (once)."""
    if model.is_dir():
        return model
    target = cache / (model.stem + "-f32")
    if not (target / "config.json").is_file():
        import torch
        import transformers

        kwargs = {"gguf_file": model.name}
        transformers.AutoTokenizer.from_pretrained(model.parent, **kwargs).save_pretrained(target)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(model.parent, dtype=torch.float32, **kwargs)
        config = loaded.config
        del config.quantization_config  # transformers refuses to save a model it read from GGUF as such
        plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(target)
    return target


@dataclass
class Scores:
    metrics: dict[str, float]  # acc, acc_norm
    loglikelihoods: list[list[float]]  # per item (in doc order), each choice's


def lm_eval(model: str, model_args: str, tasks: Path, out: Path, *extra: str) -> Scores:
    """Run the `lm_eval` command; the task's metrics and every choice's loglikelihood."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
                    "--tasks", TASK, "--include_path", str(tasks), "--output_path", str(out), "--log_samples",
                    *extra], check=True, env=env, stdout=subprocess.DEVNULL)
    result = json.loads(next(out.rglob("results_*.json")).read_text())["results"][TASK]
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()]
    return Scores({name.split(",")[0]: value for name, value in result.items()
                   if name.split(",")[0] in ("acc", "acc_norm")},
                  [[float(r[0]) for r in s["filtered_resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])])


def compare(model: Path, items: int, work: Path) -> dict[str, Scores]:
    """{"served": scores, "hf": scores} on the same folder and task."""
    folder = hf_folder(model, work)
    tasks = write_task(work / "tasks", items)
    with ServerProcess([str(folder), "--dtype", "float32", "--kv-cache-dtype", "float32", "--device", "cpu",
                        "--grpc-port", "0", "--disable-uvicorn-access-log"]) as server:
        served = lm_eval("local-completions",
                         f"base_url={server.base_url}/v1/completions,tokenizer_backend=remote,tokenized_requests=True,"
                         "num_concurrent=2,max_retries=1", tasks, work / "served", "--batch_size", "4")
    # lm-eval's hf backend encodes with the tokenizer's special tokens (a BOS, for some), local-completions'
    # remote tokenizer without: the same tokens on both sides need add_bos_token=False
    hf = lm_eval("hf", f"pretrained={folder},dtype=float32,add_bos_token=False", tasks, work / "hf", "--device", "cpu",
                 "--batch_size", "8")
    return {"served": served, "hf": hf}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--items", type=int, default=300)
    parser.add_argument("--work", type=Path, default=Path(".cache/lm-eval"))
    args = parser.parse_args(argv)
    scores = compare(args.model, args.items, args.work)
    print(f"{args.items} items of {TASK} on {args.model.name}")
    for side, score in scores.items():
        print(f"  lm_eval --model {'local-completions' if side == 'served' else 'hf':18s}" +
              "  ".join(f"{name} {value:.4f}" for name, value in score.metrics.items()))
    gaps = [abs(a - b) for ours, theirs in zip(scores["served"].loglikelihoods, scores["hf"].loglikelihoods,
                                               strict=True) for a, b in zip(ours, theirs, strict=True)]
    print(f"  largest loglikelihood gap over {len(gaps)} choices: {max(gaps):.2e}")


if __name__ == "__main__":
    main()
