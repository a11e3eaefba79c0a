"""A chat's images: each image part decoded (checked against the server's limits first), and the messages in the
form a vision model's chat template reads (content as a list of text and image parts)."""

from __future__ import annotations

from typing import Any

from pagegate.engine.media.images import DecodedImage, ImageLimits, check_count, image_from_url
from pagegate.gateway.errors import BadRequest
from pagegate.gateway.protocol import ChatMessage


def chat_images(messages: list[ChatMessage], takes_images: bool, limits: ImageLimits) -> list[DecodedImage]:
    """The messages' images in order, decoded; a 400 naming the part when one is bad, when there are more than
    the limit, or when the model takes none."""
    found = [(f"messages.{i}.content.{j}.image_url", image.url)
             for i, message in enumerate(messages) for j, image in message.image_urls()]
    if not found:
        return []
    if not takes_images:
        raise BadRequest("This model does not take images: send text only, or serve a vision model.",
                         param=found[0][0])
    check_count(len(found), "messages", limits)
    return [image_from_url(url, param, limits) for param, url in found]


def template_parts(dicts: list[dict[str, Any]], image_token: str) -> list[dict[str, Any]]:
    """Each message's text content as parts, as vision templates iterate them (transformers' processors pass
    them so): the text between `image_token`s as text parts, each `image_token` an image part."""
    return [{**item, "content": _parts(item["content"], image_token)} if isinstance(item.get("content"), str)
            else item for item in dicts]


def _parts(text: str, image_token: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(text.split(image_token)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts or [{"type": "text", "text": ""}]
