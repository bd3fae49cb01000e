"""The tool warm start: supervised on scripted calculator episodes, recorded by the rollout's own episode path.

A freshly built tiny policy never writes a tool call, so GRPO on ``arith_tools`` (3-digit additions: beyond what
its weights can add) sees no reward and no tool use to reinforce. ``warm_start_tools`` plays scripted episodes
through ``EpisodeRunner``, the code a run plays episodes with: the opening is the chat template with the tool
schemas, the calculator really runs, its results come back as the template's delta ids, and a turn ends on the
run's stop string as the engines cut it. The loss covers the model turns only (``model_mask``), so the warm start
teaches exactly the token layout and call format the run's parser reads.

Two stages, so GRPO has something to improve that held-out validation shows. First the call format and the
copying of operands: ``calculator_script``, where half the episodes ``add`` the operands, ``submit`` the sum and end,
the other half answer at once with a guess in text. Then the habit the run must unlearn, over the last ``settle``
steps with the lr decaying to 0: ``guess_script``, where only ``share`` of the episodes add first and the others
``submit`` a guess at once, the add skipped (reward 0: the answer needs the tool's result). The settled policy opens
with ``add`` about ``share`` of the time, so greedy decoding submits a guess; GRPO rewards the sampled episodes that
add first, and greedy decoding soon adds too.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_grpo.data.tasks import get_task
from lightning_grpo.envs.config import EnvConfig
from lightning_grpo.envs.episode import EpisodeRunner
from lightning_grpo.rollout.base import Prompt, Rollout, SamplingConfig, finish_rollout
from lightning_grpo.tiny.sft import WarmStartResult, sft

TOOL_TASK = "arith_tools"
"""The built-in task whose warm start (``policy.warm_start``) is scripted calculator episodes, not answers."""
TOOL_EPISODES = EnvConfig(
    name="calculator", parser="pythonic", max_turns=3, max_tool_response_tokens=16
)
"""The episodes the warm start plays: ``model.env`` of configs/tools-quickstart.yaml (a test checks they agree)."""
TOOL_STOP = (")",)
"""The quickstart's ``rollout.stop``: a call ends its turn, so the model reads the result in the next one."""

Script = Callable[[Prompt], tuple[str, bool]]
"""A scripted policy: the next turn's text of the episode whose turn prompt this is, and whether it ends with EOS."""


class ScriptedTurns:
    """A rollout engine whose turns a script writes (the warm start's teacher; ``EpisodeRunner`` only calls
    ``generate``). Each turn is returned as an engine returns it: EOS appended to a final turn, and ids and text cut
    at the sampling's stop strings by ``finish_rollout``."""

    def __init__(self, tokenizer, script: Script) -> None:
        self.tokenizer = tokenizer
        self.script = script

    def generate(
        self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingConfig
    ) -> list[Rollout]:
        out = []
        for prompt in prompts:
            for _ in range(group_size):
                text, final = self.script(prompt)
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                ids = list(ids) + [self.tokenizer.eos_token_id] * final
                out.append(
                    finish_rollout(
                        prompt, ids, text, "stop", None, sampling, self._decode
                    )
                )
        return out

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def calculator_script(share: float, seed: int) -> Script:
    """Per episode (by row id, seeded): with probability ``share`` ``add(a=.., b=..)``, ``submit(answer=<sum>)``, then
    an empty final turn; otherwise a guessed sum in text, no call. Operands come from the prompt's row (``meta``)."""
    turns: dict[int, int] = {}

    def script(prompt: Prompt) -> tuple[str, bool]:
        turn = turns[prompt.id] = turns.get(prompt.id, -1) + 1
        a = prompt.meta["a"]
        b = prompt.meta["b"]
        rng = random.Random(f"{seed}-{prompt.id}")
        if rng.random() >= share:
            # answers in its head: wrong, and no call
            return str(rng.randint(0, 2 * max(a, b, 1))), True
        return [f"add(a={a}, b={b})", f"submit(answer={a + b})", ""][turn], turn == 2

    return script


def guess_script(share: float, seed: int) -> Script:
    """Per episode (by row id, seeded): with probability ``share`` ``add(a=.., b=..)``, ``submit(answer=<sum>)``, then
    an empty final turn; otherwise ``submit(answer=<guess>)`` at once, the add skipped (a wrong guess: reward 0), then
    an empty final turn."""
    turns: dict[int, int] = {}

    def script(prompt: Prompt) -> tuple[str, bool]:
        turn = turns[prompt.id] = turns.get(prompt.id, -1) + 1
        a = prompt.meta["a"]
        b = prompt.meta["b"]
        rng = random.Random(f"{seed}-{prompt.id}")
        if rng.random() < share:
            text = [f"add(a={a}, b={b})", f"submit(answer={a + b})", ""][turn]
            return text, turn == 2
        guess = rng.randint(0, 2 * max(a, b, 1))
        # never right by chance: only the tool's result earns the reward
        guess += guess == a + b
        return [f"submit(answer={guess})", ""][turn], turn == 1

    return script


class ScriptedBatches:
    """``sft``'s ``batch_of``: loop step ``step`` plays the script's episodes on ``batch_size`` items from
    ``(first + step) * batch_size`` on, and returns them as supervised rows."""

    SAMPLING = SamplingConfig(max_new_tokens=64, stop=TOOL_STOP)
    """A turn's cap, and the run's stop string (a call ends its turn)."""

    def __init__(
        self,
        items: Sequence,
        runner: EpisodeRunner,
        engine: ScriptedTurns,
        batch_size: int,
        first: int,
    ) -> None:
        self.items = items
        self.runner = runner
        self.engine = engine
        self.batch_size = batch_size
        self.first = first

    def __call__(self, step: int):
        start = (self.first + step) * self.batch_size
        prompts = [
            Prompt(
                start + i,
                [],
                it.text,
                it.answer,
                dict(it.meta),
                [{"role": "user", "content": it.text}],
            )
            for i, it in enumerate(self.items[start : start + self.batch_size])
        ]
        episodes, _ = self.runner.play(self.engine, prompts, 1, self.SAMPLING)
        pad_id = self.engine.tokenizer.pad_token_id
        return (*episode_rows(episodes, pad_id), {})


def warm_start_tools(
    model: nn.Module,
    tokenizer,
    task: str = TOOL_TASK,
    steps: int = 300,
    seed: int = 0,
    batch_size: int = 32,
    lr: float = 3e-3,
    share: float = 0.35,
    settle: int = 100,
) -> WarmStartResult:
    """Supervised passes on scripted ``TOOL_EPISODES`` of ``task``'s train split: the loss on the model turns only.

    Args:
        model: a causal LM whose tokenizer has a chat template (the tiny policies': ``tiny.chat_template``).
        tokenizer: its tokenizer.
        task: a built-in task whose items carry their operands in ``meta`` (``a``, ``b``).
        steps: optimizer steps in all (AdamW), ``batch_size`` episodes each: ``steps - settle`` at a constant ``lr``
            on ``calculator_script`` (half the episodes use the tool), then ``settle`` with a fresh AdamW, the lr
            decaying linearly towards 0, on ``guess_script`` (``share`` use it). Without the decay the last batches'
            noise, not ``share``, decides how often the policy opens with ``add`` (measured: 0.61 for ``share``
            0.4 after 400 constant-lr steps), so greedy decoding may already call it.
        seed: seeds the item draw, the scripts' choices and any dropout.
        share: fraction of the settling episodes that add before submitting (the rest submit a guess).
        settle: the steps of the second stage (``min(settle, steps)``).
    """
    settle = min(settle, steps)
    items = get_task(task).items(steps * batch_size, seed, "train")
    runner = EpisodeRunner(TOOL_EPISODES, tokenizer, [tokenizer.eos_token_id])

    def batches(script: Script, first: int) -> ScriptedBatches:
        engine = ScriptedTurns(tokenizer, script)
        return ScriptedBatches(items, runner, engine, batch_size, first)

    formats = sft(
        model, steps - settle, seed, lr, batches(calculator_script(0.5, seed), 0)
    )
    if not settle:
        return formats
    settled = sft(
        model,
        settle,
        seed,
        lr,
        batches(guess_script(share, seed), steps - settle),
        cooldown=settle,
    )
    return WarmStartResult(steps, settled.loss, formats.seconds + settled.seconds)


def episode_rows(
    episodes: Sequence[Rollout], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)`` of right-padded ``opening + episode`` rows; labels -100 except on the
    ids the model wrote (``model_mask``): openings, tool results and turn separators are context."""
    rows = [list(e.prompt.token_ids) + list(e.token_ids) for e in episodes]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(rows), width), dtype=torch.bool)  # [B, T]
    for i, (row, e) in enumerate(zip(rows, episodes)):
        start = len(e.prompt.token_ids)
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
        model = torch.tensor(e.model_mask or [True] * len(e.token_ids))  # [T_episode]
        labels[i, start : len(row)] = torch.where(
            model, torch.tensor(e.token_ids), -100
        )
    return ids, mask, labels
