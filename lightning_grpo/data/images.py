"""Image references in prompt records, and loading them into pixels when (and only when) needed.

A record carries *references*: a file path, raw bytes, a ``PIL.Image``, or a ``datasets`` Image cell
(``{"bytes": ..., "path": ...}`` when the column is not decoded; a ``PIL.Image`` when it is). The
collected batch keeps these references; pixels are decoded for the prompts being generated, and
again for each chunk being trained or scored (``vision.py``), then dropped.

Chat prompts follow TRL's multimodal format: a content part ``{"type": "image"}`` marks where the
next image of the row's ``images`` column goes; Qwen-style inline parts
(``{"type": "image", "image": <ref>}``) are moved into that list, so every record has one form.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ImageRef = Any
"""A path (str or Path), bytes, a ``PIL.Image.Image``, or a ``{"bytes", "path"}`` mapping (``datasets`` Image)."""


class BadImageError(ValueError):
    """An image of a record cannot be read; the message names the record id and the image's path."""


def is_image_ref(value: Any) -> bool:
    """True for a single image reference (not a list of them)."""
    if isinstance(value, (str, Path, bytes, bytearray)):
        return True
    if isinstance(value, Mapping):
        return value.get("bytes") is not None or value.get("path") is not None
    return hasattr(value, "convert") and hasattr(value, "size")  # PIL.Image.Image


def as_refs(value: Any) -> tuple[ImageRef, ...]:
    """A row's image column as a tuple of references: None -> (), one reference -> (ref,), a list -> tuple."""
    if value is None:
        return ()
    if is_image_ref(value):
        return (value,)
    if isinstance(value, Sequence):
        refs = tuple(v for v in value if v is not None)
        bad = next((v for v in refs if not is_image_ref(v)), None)
        if bad is not None:
            raise TypeError(f"not an image reference: {type(bad).__name__} {bad!r:.60}")
        return refs
    raise TypeError(f"not an image reference: {type(value).__name__} {value!r:.60}")


def describe(ref: ImageRef) -> str:
    """Where an image comes from, for messages: its path, else what it is."""
    if isinstance(ref, (str, Path)):
        return str(ref)
    if isinstance(ref, Mapping):
        return str(ref.get("path") or f"<{len(ref.get('bytes') or b'')} bytes>")
    if isinstance(ref, (bytes, bytearray)):
        return f"<{len(ref)} bytes>"
    return f"<{type(ref).__name__} {getattr(ref, 'size', '')}>"


def load_image(ref: ImageRef, record_id: int | None = None):
    """The image as a decoded RGB ``PIL.Image`` (fully read, so a truncated file fails here, not later).

    Raises:
        BadImageError: the file is missing or not an image; the message names the record id and path.
    """
    from PIL import Image

    try:
        if hasattr(ref, "convert") and hasattr(ref, "size"):
            image = ref
        elif isinstance(ref, (bytes, bytearray)):
            image = Image.open(io.BytesIO(ref))
        elif isinstance(ref, Mapping):
            data = ref.get("bytes")
            image = (
                Image.open(io.BytesIO(data))
                if data is not None
                else Image.open(Path(ref["path"]).expanduser())
            )
        else:
            image = Image.open(Path(ref).expanduser())
        image.load()
        return image.convert("RGB")
    # noqa: BLE001 - any decoder failure is the same user-facing problem
    except Exception as err:
        where = f"record id={record_id}: " if record_id is not None else ""
        raise BadImageError(
            f"{where}cannot read image {describe(ref)} ({type(err).__name__}: {err}). Fix or remove it from the "
            "data, or set data.on_bad_record=skip to skip such records (counted in data/bad_records_skipped)"
        ) from None


def missing_files(refs: Sequence[ImageRef]) -> list[str]:
    """The paths among ``refs`` that name no file (bytes and decoded images have nothing to check): found before
    training by a stat, instead of at the loop step that draws the row."""
    paths = [
        r.get("path") if isinstance(r, Mapping) and r.get("bytes") is None else r
        for r in refs
    ]
    return [
        str(p)
        for p in paths
        if isinstance(p, (str, Path)) and not Path(p).expanduser().is_file()
    ]


def load_images(refs: Sequence[ImageRef], record_id: int | None = None) -> list:
    """Every image of one record, decoded (see ``load_image``)."""
    return [load_image(r, record_id) for r in refs]


def split_inline_images(
    messages: list[dict],
) -> tuple[list[dict], tuple[ImageRef, ...]]:
    """``(messages with bare {"type": "image"} parts, the inline images in order)``.

    Qwen-style parts carry the image (``{"type": "image", "image": ref}``); TRL's carry none and take
    the row's ``images`` column in order. Both end up as bare parts plus a list of references.
    """
    inline: list[ImageRef] = []
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, Mapping) and part.get("type") == "image":
                    ref = (
                        part.get("image")
                        if part.get("image") is not None
                        else part.get("url")
                    )
                    if ref is not None:
                        inline.append(ref)
                    parts.append({"type": "image"})
                elif isinstance(part, Mapping):
                    # datasets pads missing keys
                    parts.append({k: v for k, v in part.items() if v is not None})
                else:
                    parts.append(part)
            m = {**m, "content": parts}
        out.append(m)
    return out, tuple(inline)


def count_image_parts(messages: list[dict] | None) -> int:
    """How many ``{"type": "image"}`` placeholders the messages hold."""
    if not messages:
        return 0
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, Mapping) and p.get("type") == "image"
    )


IMAGE_MARKER = "<image>"
"""Where an image goes in a plain-text prompt (LLaVA-style data such as Geometry3K); one per image."""


def with_image_parts(text: str, n_images: int) -> list[dict]:
    """A plain prompt with ``n_images`` images as one user message: each image where the text has an ``<image>``
    marker when there is one per image, else the images first, then the text."""
    if n_images and text.count(IMAGE_MARKER) == n_images:
        content: list[dict] = []
        for i, piece in enumerate(text.split(IMAGE_MARKER)):
            if i:
                content.append({"type": "image"})
            if piece.strip():
                content.append({"type": "text", "text": piece})
        return [{"role": "user", "content": content}]
    return [
        {
            "role": "user",
            "content": [{"type": "image"}] * n_images
            + [{"type": "text", "text": text}],
        }
    ]


def text_of(messages: list[dict]) -> str:
    """The last message's text (for display), whether its content is a string or a list of parts."""
    content = messages[-1].get("content")
    if isinstance(content, str):
        return content
    return " ".join(
        str(p.get("text", ""))
        for p in content
        if isinstance(p, Mapping) and p.get("type") == "text"
    )
