"""A chat's images: each image part decoded, checked against the server's limits first."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagegate.engine.media.limits import ImageLimits, check_count
from pagegate.gateway.errors import BadRequest
from pagegate.gateway.protocol import ChatMessage

if TYPE_CHECKING:
    from pagegate.engine.media.images import DecodedImage


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
    from pagegate.engine.media.images import image_from_url  # PIL and numpy: at a chat's first image

    return [image_from_url(url, param, limits) for param, url in found]
