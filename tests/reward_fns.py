"""Reward functions loaded by import path in test_rewards.py (``reward_fns:...``)."""


def length_reward(rollouts):
    return [float(len(r.text)) for r in rollouts]


def fails_on_seven(rollouts):
    return [1.0 / (r.prompt.id != 7) for r in rollouts]


def one_short(rollouts):
    return [0.0] * (len(rollouts) - 1)


def nan_at_two(rollouts):
    return [float("nan") if r.prompt.id == 2 else 0.0 for r in rollouts]


def fails_as_batch(rollouts):
    if len(rollouts) > 1:
        raise RuntimeError("reward server rejected the batch")
    return [0.0]


NOT_CALLABLE = 3


# -- TRL-style functions (fn(prompts, completions, **columns)) --------------------------------------------------


def trl_exact(prompts, completions, answer, **kwargs):
    """TRL's usual shape: the reference column arrives by name."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def trl_chat(prompts, completions, **kwargs):
    """Conversational: prompts and completions are chat messages."""
    return [float(p[-1]["role"] == "user" and c[0]["role"] == "assistant") for p, c in zip(prompts, completions)]


def trl_no_opinion_on_odd(completions, completion_ids, **kwargs):
    return [None if i % 2 else float(len(ids)) for i, ids in enumerate(completion_ids)]


def trl_needs_difficulty(prompts, completions, difficulty):
    return [float(d) for d in difficulty]


def unsupported(first, second):
    return []


# -- return values ---------------------------------------------------------------------------------------------


def returns_strings(rollouts):
    return ["1.0"] * len(rollouts)


def returns_text(rollouts):
    return "1" * len(rollouts)


def returns_int_keyed_dict(rollouts):
    return {i: 1.0 for i in range(len(rollouts))}


def returns_numpy(rollouts):
    import numpy as np

    return [np.float32(0.5), np.int64(1), np.bool_(True), True, 2][: len(rollouts)]


def returns_array(rollouts):
    import numpy as np

    return np.full(len(rollouts), 0.25)


# -- misbehaving functions -------------------------------------------------------------------------------------

CALLS = []
"""Batch sizes of every call of ``counted_failure``."""


def counted_failure(rollouts):
    CALLS.append(len(rollouts))
    raise KeyError("no_such_field")


def edits_in_place(rollouts):
    for r in rollouts:
        r.token_ids.append(3)
        r.token_ids[0] = 5
        r.prompt.token_ids.clear()
        r.prompt.meta["answer"] = "edited"
    rollouts.reverse()
    return [1.0] * len(rollouts)


def trl_edits_in_place(prompts, completions, completion_ids, answer, **kwargs):
    for ids in completion_ids:
        ids.append(3)
    answer[:] = ["edited"] * len(answer)
    return [0.0] * len(completions)


RELEASE = __import__("threading").Event()
"""Set to let ``hangs`` return (tests release it when done)."""


def hangs(rollouts):
    RELEASE.wait()
    return [0.0] * len(rollouts)


def beyond_float32(rollouts):
    """1e39: finite in float64, inf in float32."""
    return [1e39] * len(rollouts)


def hangs_from_prompt_4(rollouts):
    """The tiny job's loop step 3 (prompts 4 and 5) waits until ``RELEASE`` is set; every call scores 0."""
    if min(r.prompt.id for r in rollouts) >= 4:
        RELEASE.wait()
    return [0.0] * len(rollouts)
