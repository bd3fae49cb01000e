"""The chat template's tokens between model turns: what an episode appends after a turn that called tools.

Rendered once per tool step on a stand-in conversation (a user message, an assistant message whose content is a
marker, then the tool messages, then the generation prompt) and cut right after the marker: that suffix is the
template's own delta for the new messages (end of the assistant turn, the tool turn(s), the next assistant
opening), whatever the real conversation holds. Only this delta is tokenized; the model's turns are never
rendered or re-tokenized, so the record keeps the ids the sampler drew (``episode.py``).

Cutting after the marker (rather than diffing two renderings) also holds for templates that render the last
assistant turn differently from earlier ones (Qwen3 adds an empty think block to the last one only).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_grpo.checks import ConfigError

# invisible separators: no real content contains this
_MARK = "\u2063LGRPO-MODEL-TURN\u2063"


class TurnDelta:
    """Token ids of the template's delta after a model turn that called tools.

    Args:
        tokenizer: the policy's tokenizer, with a chat template.
        tools: the tool schemas (rendered in the system prompt by templates that show them).
        eos_token_ids: ids that end a model turn; when the turn ended on one, the delta starts after its text.
    """

    def __init__(
        self, tokenizer, tools: Sequence[dict], eos_token_ids: Sequence[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.eos_texts = {t: tokenizer.decode([t]) for t in eos_token_ids}

    def ids(
        self, results: Sequence[tuple[str, str]], last_token: int | None
    ) -> list[int]:
        """The delta for tool ``results`` (``(name, text)`` pairs) after a turn whose last sampled id is
        ``last_token``."""
        messages = [
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": _MARK},
        ]
        messages += [
            {"role": "tool", "name": name, "content": text} for name, text in results
        ]
        rendered = self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools or None,
            add_generation_prompt=True,
            tokenize=False,
        )
        if rendered.count(_MARK) != 1:
            raise ConfigError(
                "the policy's chat template does not render an assistant message's content verbatim "
                "once; a multi-turn environment needs a template that does (set policy.chat_template)"
            )
        delta = rendered[rendered.index(_MARK) + len(_MARK) :]
        eos = self.eos_texts.get(last_token)
        # the model already closed its turn with this token: not twice
        if eos and delta.startswith(eos):
            delta = delta[len(eos) :]
        return list(self.tokenizer(delta, add_special_tokens=False)["input_ids"])


def first_prompt(tokenizer, messages: list[dict], tools: Sequence[dict]) -> list[int]:
    """Token ids of an episode's opening: the prompt messages rendered with the tool schemas, ending with the
    assistant opening. The prompt is the dataset's text, not the model's: tokenizing it is safe."""
    text = opening_text(tokenizer, messages, tools)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def opening_text(tokenizer, messages: list[dict], tools: Sequence[dict]) -> str:
    """An episode's opening as text: what ``first_prompt`` tokenizes (the completions log shows it)."""
    return tokenizer.apply_chat_template(
        messages, tools=list(tools) or None, add_generation_prompt=True, tokenize=False
    )
