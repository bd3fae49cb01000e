"""Built-in visual task: synthetic images a tiny vision-language policy learns on a CPU in minutes.

``colors``: a 56x56 image (4 placeholder tokens for the tiny Qwen2.5-VL) of a coloured square of
random size and place on a dark background with noise; the prompt asks ``which color?`` and the
answer is the square's colour name (``red``, ``green``, ``blue``, ``yellow``). The text alone never
tells: only the pixels do, so a rising reward means the policy reads the image. Images travel as
PNG bytes (a few hundred bytes each), exactly like a ``datasets`` Image column, and are decoded
per chunk like any other.

``tiny.warm.warm_start_vision`` is the supervised warm start of a tiny VLM on such a task.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

from lightning_grpo.data.images import with_image_parts
from lightning_grpo.data.items import Split, TaskItem

COLORS = {
    "red": (220, 30, 30),
    "green": (30, 200, 40),
    "blue": (40, 60, 230),
    "yellow": (230, 220, 30),
}


def square_png(
    color: tuple[int, int, int], rng: random.Random, size: int = 56
) -> bytes:
    """PNG bytes of a ``color`` square (random side 16-40 px, random place) on a noisy dark background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), tuple(rng.randint(0, 50) for _ in range(3)))
    side = rng.randint(16, 40)
    x = rng.randint(0, size - side)
    y = rng.randint(0, size - side)
    shade = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in color)
    ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=shade)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class ColorTask:
    """The question "which color?" about a synthetic image; answer the colour name of its square (see the module docstring).

    Train and val draws use separate seed streams (the images differ; the four answers are shared).
    Measured in ``docs/vlm.md`` (tiny Qwen2.5-VL, CPU).
    """

    question: str = "which color?"
    name: str = "colors"
    reward: str = "exact"

    def items(self, n: int, seed: int, split: Split = "train") -> list[TaskItem]:
        rng = random.Random(f"{self.name}-{seed}-{split}")
        names = sorted(COLORS)
        out = []
        for _ in range(n):
            color = rng.choice(names)
            png = square_png(COLORS[color], rng)
            out.append(
                TaskItem(
                    self.question,
                    color,
                    {"color": color},
                    with_image_parts(self.question, 1),
                    (png,),
                )
            )
        return out
