"""Replay engine: serves pre-recorded rollouts from a JSONL file instead of generating.

For offline / replayed RL and for exact tests. One JSON object per line::

    {"prompt_id": 0, "prompt_ids": [1, 5, 9], "completion_ids": [7, 2], "reward": 1.0,
     "logprobs": [-0.3, -1.2]}          # logprobs optional (sampler logprobs of completion_ids)

Lines sharing a ``prompt_id`` form one group, in file order. ``generate`` answers prompt
``p`` with recorded group ``p.id % n_groups``, so the deterministic prompt stream replays
the file in order and wraps around. Nothing in the file is executed: it is parsed as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from torch import Tensor

from lightning_grpo.rollout.base import Prompt, Rollout, SamplingConfig

REQUIRED = ("prompt_id", "prompt_ids", "completion_ids", "reward")


class ReplayEngine:
    """Serves recorded groups; ``sleep``/``wake_up``/``load_weights`` have nothing to do."""

    holds_weights = False
    """Recorded rollouts: no weights go stale, so no weight publisher is needed."""

    def __init__(
        self,
        path: str | Path,
        eos_token_id: int | None = None,
        need_logprobs: str | None = None,
    ) -> None:
        """``need_logprobs``: the knob that consumes sampler logprobs (every record must then carry them)."""
        self.path = Path(path)
        self.eos_token_id = eos_token_id
        self.groups: list[list[dict]] = []
        index: dict[int, int] = {}
        for lineno, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            missing = [k for k in REQUIRED if k not in rec]
            if missing:
                raise ValueError(
                    f"{self.path}:{lineno}: replay record lacks {missing}; each line needs {REQUIRED}"
                )
            if need_logprobs and "logprobs" not in rec:
                raise ValueError(
                    f"{self.path}:{lineno}: the record has no 'logprobs' field, which {need_logprobs} "
                    "needs (the sampler's logprob of each completion token); record them, or set "
                    "rl.rollout_correction.mode=off"
                )
            if "logprobs" in rec and len(rec["logprobs"]) != len(rec["completion_ids"]):
                raise ValueError(
                    f"{self.path}:{lineno}: {len(rec['logprobs'])} logprobs for "
                    f"{len(rec['completion_ids'])} completion tokens"
                )
            if rec["prompt_id"] not in index:
                index[rec["prompt_id"]] = len(self.groups)
                self.groups.append([])
            self.groups[index[rec["prompt_id"]]].append(rec)
        if not self.groups:
            raise ValueError(f"{self.path}: no replay records (empty file)")
        self.asleep = False

    def generate(
        self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingConfig
    ) -> list[Rollout]:
        out = []
        for prompt in prompts:
            group = self.groups[prompt.id % len(self.groups)]
            if len(group) < group_size:
                raise ValueError(
                    f"{self.path}: recorded group {group[0]['prompt_id']} has {len(group)} completions, "
                    f"rl.group_size={group_size} needs that many"
                )
            served = Prompt(
                id=prompt.id,
                token_ids=list(group[0]["prompt_ids"]),
                text=prompt.text,
                answer=prompt.answer,
            )
            out += [self._rollout(served, rec, sampling) for rec in group[:group_size]]
        return out

    def _rollout(self, prompt: Prompt, rec: dict, sampling: SamplingConfig) -> Rollout:
        ids = list(rec["completion_ids"])
        stopped = (
            self.eos_token_id is not None and bool(ids) and ids[-1] == self.eos_token_id
        )
        return Rollout(
            prompt=prompt,
            token_ids=ids,
            text=rec.get("text", ""),
            finish_reason="stop" if stopped else "length",
            logprobs=list(rec["logprobs"]) if "logprobs" in rec else None,
            reward=float(rec["reward"]),
        )

    def sleep(self, level: int = 1) -> None:
        self.asleep = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.asleep = False

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        for _ in named_tensors:  # consume: callers may pass a generator
            pass

    def reset_prefix_cache(self) -> None:
        pass
