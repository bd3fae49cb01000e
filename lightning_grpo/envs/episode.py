"""Multi-turn episodes, token in token out: the record is the ids the sampler drew plus the environment's ids.

Each turn, every live episode continues from its own token ids (``Prompt.token_ids`` = opening + turns so far),
batched in one ``engine.generate`` call (episodes that ended drop out; both engines take token-id prompts). A
turn's sampled ids, and their sampler logprobs, are appended as they are (``model_mask`` True). When the turn
calls tools, their results go back as the chat template's delta for the new messages (``template.TurnDelta``),
appended as ids with ``model_mask`` False: context for the next turn, never trained, never in a divisor. No
model text is ever decoded and re-encoded into the record; the turn's text is only parsed for tool calls. Beside the
record, each episode keeps a ``Transcript`` for people (its opening as text, each turn's text, calls and results:
``completions.jsonl``, ``lightning-grpo show``); nothing is trained from it.

Limits: ``max_turns`` (still calling tools after the last one: truncated), ``max_total_tokens`` (a turn never
runs past it; reaching it truncates), ``max_tool_response_tokens`` (longer results cut). Truncations are counted
(``episode/truncated_frac``, ``episode/tool_results_cut``), never silent.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from lightning_grpo.checks import ConfigError
from lightning_grpo.envs.config import EnvConfig
from lightning_grpo.envs.environment import (
    EnvClass,
    Environment,
    episode_reward,
    first_observation,
    load_env,
    load_parser,
    row_of,
)
from lightning_grpo.envs.parse import ToolCall
from lightning_grpo.envs.template import TurnDelta, first_prompt, opening_text
from lightning_grpo.envs.tools import Tool, ToolResult, call_tool
from lightning_grpo.rollout.base import (
    Prompt,
    Rollout,
    RolloutEngine,
    SamplingConfig,
    Transcript,
    Turn,
)
from lightning_grpo.rollout.sampler import sample_seed


@dataclass
class _Episode:
    # the opening as a prompt: the dataset's messages rendered with the tool schemas
    prompt: Prompt
    env: Environment
    tools: dict[str, Tool]
    # everything after the opening: model and environment ids
    ids: list[int] = field(default_factory=list)
    # per id, True where the sampler drew it
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    failures: int = 0
    cut_results: int = 0
    truncated: bool = False
    done: bool = False
    # False once a turn came back without sampler logprobs (none asked for)
    with_logprobs: bool = True
    text: str = ""  # the last model turn's text (what reward functions read)
    opening: str = ""  # the prompt as the model saw it (the completions log shows it)
    # every model turn with its calls and results, as text
    log: list[Turn] = field(default_factory=list)

    def length(self) -> int:
        return len(self.prompt.token_ids) + len(self.ids)

    def append(
        self, ids: Sequence[int], sampled: bool, logprobs: Sequence[float] | None = None
    ) -> None:
        self.ids += ids
        self.mask += [sampled] * len(ids)
        # 0: context, never read
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.with_logprobs &= logprobs is not None or not sampled

    def rollout(self) -> Rollout:
        return Rollout(
            prompt=self.prompt,
            token_ids=self.ids,
            text=self.text,
            finish_reason="length" if self.truncated else "stop",
            logprobs=self.logprobs if self.with_logprobs else None,
            reward=episode_reward(self.env),
            model_mask=self.mask,
            transcript=Transcript(self.opening, tuple(self.log)),
        )


class EpisodeRunner:
    """Plays ``group_size`` episodes per prompt with an engine; one instance per run (the env class loaded once).

    Args:
        cfg: the environment section (``model.env``).
        tokenizer: the policy's tokenizer, with a chat template.
        eos_token_ids: ids that end a model turn.
        context: the model context in tokens (None = unknown): bounds ``max_total_tokens``.

    Example::

        runner = EpisodeRunner(EnvConfig(name="calculator"), tokenizer, [tokenizer.eos_token_id])
        rollouts, metrics = runner.play(engine, prompts, group_size=4, sampling=SamplingConfig(seed=0))
    """

    def __init__(
        self,
        cfg: EnvConfig,
        tokenizer,
        eos_token_ids: Sequence[int],
        context: int | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"model.env.name={cfg.name!r}: the policy's tokenizer has no chat template, which "
                "renders the tool schemas and tool turns; use a chat model or set policy.chat_template"
            )
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.env_class: EnvClass = load_env(cfg.name)
        self.parse = load_parser(cfg.parser)
        self.delta = TurnDelta(tokenizer, self.env_class.schemas, eos_token_ids)
        limits = [n for n in (cfg.max_total_tokens, context) if n is not None]
        self.max_total = min(limits) if limits else None
        floor = len(
            first_prompt(
                tokenizer, [{"role": "user", "content": ""}], self.env_class.schemas
            )
        )
        # no prompt could open an episode
        if self.max_total is not None and self.max_total <= floor:
            raise ConfigError(
                f"model.env.max_total_tokens={cfg.max_total_tokens} (model context {context}) leaves no "
                f"room: an empty prompt with the tool schemas already takes {floor} tokens; raise "
                "max_total_tokens (or leave it null: the model context)"
            )

    def play(
        self,
        engine: RolloutEngine,
        prompts: Sequence[Prompt],
        group_size: int,
        sampling: SamplingConfig,
    ) -> tuple[list[Rollout], dict[str, float]]:
        """``group_size`` episodes per prompt, prompt 0's group first, and their ``tools/*``, ``episode/*`` metrics."""
        episodes = [
            self._start(p, p.id * group_size + j)
            for p in prompts
            for j in range(group_size)
        ]
        workers = self.cfg.tool_workers
        with (
            ThreadPoolExecutor(workers, "episode-tools")
            if workers > 1
            else contextlib.nullcontext() as pool
        ):
            for turn in range(self.cfg.max_turns):
                live = [e for e in episodes if not e.done]
                if not live:
                    break
                # a stream per turn
                seed = (
                    None
                    if sampling.seed is None
                    else sample_seed(sampling.seed, turn, 0)
                )
                last = turn == self.cfg.max_turns - 1
                for max_new, group in self._by_budget(live, sampling.max_new_tokens):
                    self._turn(
                        engine,
                        group,
                        replace(sampling, max_new_tokens=max_new, seed=seed),
                        last,
                        pool,
                    )
        return [e.rollout() for e in episodes], _metrics(episodes)

    def _start(self, prompt: Prompt, row_id: int) -> _Episode:
        env, tools = self.env_class.new()
        observation = first_observation(
            env, row_of(prompt.text, prompt.messages, prompt.answer, prompt.meta)
        )
        messages = [
            dict(m)
            for m in (prompt.messages or [{"role": "user", "content": prompt.text}])
        ]
        # TRL's convention: the first observation extends the last user message
        if observation:
            messages[-1]["content"] = f"{messages[-1]['content']}{observation}"
        opening = opening_text(self.tokenizer, messages, self.env_class.schemas)
        # as first_prompt
        ids = list(self.tokenizer(opening, add_special_tokens=False)["input_ids"])
        if self.max_total is not None and len(ids) >= self.max_total:
            raise ConfigError(
                f"prompt id={prompt.id}: its opening (with the tool schemas) has {len(ids)} tokens, not "
                f"below model.env.max_total_tokens / the model context ({self.max_total}); raise "
                "max_total_tokens or shorten the prompt (rollout.max_prompt_tokens)"
            )
        return _Episode(
            replace(prompt, id=row_id, token_ids=ids), env, tools, opening=opening
        )

    def _by_budget(
        self, live: list[_Episode], max_new: int
    ) -> list[tuple[int, list[_Episode]]]:
        """Live episodes grouped by the turn length they can afford: one batched call per group (usually one)."""
        room = {
            id(e): max_new
            if self.max_total is None
            else min(max_new, self.max_total - e.length())
            for e in live
        }
        ordered = sorted(live, key=lambda e: -room[id(e)])
        return [
            (n, list(g))
            for n, g in itertools.groupby(ordered, key=lambda e: room[id(e)])
        ]

    def _turn(
        self,
        engine: RolloutEngine,
        group: list[_Episode],
        sampling: SamplingConfig,
        last_turn: bool,
        pool: ThreadPoolExecutor | None,
    ) -> None:
        """One batched model turn of ``group``, then its tool calls: one episode's in order (they share its
        environment), the episodes side by side on ``pool`` (None: one after another)."""
        prompts = [
            replace(e.prompt, token_ids=e.prompt.token_ids + e.ids) for e in group
        ]
        outs = engine.generate(prompts, 1, sampling)
        calling = [
            (e, calls)
            for e, out in zip(group, outs)
            if (calls := self._read_turn(e, out, last_turn))
        ]
        results = (pool.map if pool is not None else map)(self._run_calls, calling)
        for (e, calls), res in zip(calling, results):
            shown = [self._result_text(e, c, r) for c, r in zip(calls, res)]
            appended = self._answer(e, shown)
            records = tuple(
                _call_record(c, text, r.failed)
                for c, (_, text), r in zip(calls, shown, res)
            )
            e.log[-1] = replace(e.log[-1], calls=records, context_tokens=appended)

    def _read_turn(
        self, e: _Episode, out: Rollout, last_turn: bool
    ) -> list[ToolCall | str]:
        """Append the model turn; the calls it makes (empty: the episode ended)."""
        e.append(out.token_ids, True, out.logprobs)
        e.turns += 1
        e.text = out.text
        e.log.append(Turn(out.text, len(out.token_ids)))
        # the turn did not end: per-turn or total budget
        if out.finish_reason == "length" or not out.token_ids:
            e.done = e.truncated = True
            return []
        calls = self.parse(out.text)
        if not calls:
            e.done = True  # the answer turn
            return []
        if last_turn:
            e.done = e.truncated = True  # still working when max_turns ran out
            e.log[-1] = replace(
                e.log[-1], calls=tuple(_call_record(c, None, False) for c in calls)
            )
            return []
        return calls

    def _answer(self, e: _Episode, results: list[tuple[str, str]]) -> int:
        """Append the tool results as the template's delta (its length returned), or end the episode where they
        leave no room (0)."""
        delta = self.delta.ids(results, e.ids[-1])
        if self.max_total is not None and e.length() + len(delta) >= self.max_total:
            # no room left for the model to read the results and answer
            e.done = e.truncated = True
            return 0
        e.append(delta, False)
        return len(delta)

    def _run_calls(
        self, calling: tuple[_Episode, list[ToolCall | str]]
    ) -> list[ToolResult]:
        """One episode's calls of a turn, in order: they share its environment."""
        e, calls = calling
        return [self._run(e, c) for c in calls]

    def _run(self, e: _Episode, call: ToolCall | str) -> ToolResult:
        """One parsed call's result; may run on a pool thread (touches nothing but the episode's own tools)."""
        if isinstance(call, str):
            return ToolResult(call, True)  # the parser's error for a malformed call
        if call.name not in e.tools:
            return ToolResult(
                f"Error: unknown tool {call.name!r}; the tools are {sorted(e.tools)}",
                True,
            )
        return call_tool(e.tools[call.name], call.arguments, self.cfg.tool_timeout_s)

    def _result_text(
        self, e: _Episode, call: ToolCall | str, result: ToolResult
    ) -> tuple[str, str]:
        """``(tool name, result text)``, counted and cut to ``max_tool_response_tokens`` (on the caller's thread:
        the tokenizer is not shared across threads)."""
        e.calls += 1
        e.failures += result.failed
        name = call.name if isinstance(call, ToolCall) else "error"
        ids = self.tokenizer(result.text, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.cfg.max_tool_response_tokens:
            return name, result.text
        e.cut_results += 1
        return name, self.tokenizer.decode(
            ids[: self.cfg.max_tool_response_tokens]
        ) + " [cut]"


def _call_record(call: ToolCall | str, result: str | None, failed: bool) -> dict:
    """A call as ``Turn.calls`` keeps it (``result`` None: not run)."""
    if isinstance(call, str):  # the parser's error for a call it could not read
        return {
            "name": "error",
            "arguments": None,
            "result": call if result is None else result,
            "failed": True,
        }
    return {
        "name": call.name,
        "arguments": call.arguments,
        "result": result,
        "failed": failed,
    }


def _metrics(episodes: list[_Episode]) -> dict[str, float]:
    """Per-episode means: every rank plays the same number of episodes, so the cross-rank mean is exact."""
    n = max(len(episodes), 1)
    return {
        "tools/call_frequency": sum(e.calls for e in episodes) / n,
        "tools/failure_frequency": sum(e.failures for e in episodes) / n,
        "episode/turns_mean": sum(e.turns for e in episodes) / n,
        "episode/truncated_frac": sum(e.truncated for e in episodes) / n,
        "episode/tool_results_cut": sum(e.cut_results for e in episodes) / n,
    }
