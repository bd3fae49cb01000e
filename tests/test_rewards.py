import math

import pytest
import torch

from lightning_grpo.data.rewards import (
    RewardError,
    RewardSpec,
    extract_answer,
    math_answer,
    normalize_answer,
    resolve_reward,
    score,
)
from lightning_grpo.rollout.base import Prompt, Rollout


def roll(text, answer="4", finish="stop", pid=0, reward=None):
    return Rollout(Prompt(pid, [5, 6], "2+2=", answer), [7], text, finish, reward=reward)


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("so the total is 72.\n#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
        ("#### 1,000", "#### 1000", 1.0),
        ("#### 42.0", "42", 1.0),
        ("#### $42.", "#### 42", 1.0),
        ("The answer is \\boxed{42}.", "#### 42", 1.0),
        ("\\boxed{\\frac{1}{2}}", "\\boxed{\\frac{1}{2}}", 1.0),
        ("#### 3.50", "3.5", 1.0),
        ("#### -7", "#### -7", 1.0),
        ("#### 41", "#### 42", 0.0),
        ("the answer is 42", "#### 42", 0.0),  # no #### / \boxed{}: no stated answer
        ("#### 7 then \\boxed{8}", "8", 1.0),  # \boxed{} wins over ####
        ("#### 4\n#### 5", "5", 1.0),  # the last #### counts
    ],
)
def test_math_answer_cases(completion, reference, expected):
    assert math_answer([roll(completion, reference)]) == [expected]


def test_normalize_answer():
    assert normalize_answer(" 1,234.000 ") == "1234"
    assert normalize_answer("+5") == "5"
    assert normalize_answer("0.50") == "0.5"
    assert normalize_answer("x=3") == "x=3"
    assert extract_answer("no answer here") is None


def test_builtins_arith_and_format():
    rollouts = [roll("4"), roll(" 4 "), roll("4", finish="length"), roll("5"), roll("four")]
    total, per = score(rollouts, [RewardSpec("arith", 1.0), RewardSpec("format", 0.5)])
    assert per["arith"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert per["format"].tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]
    torch.testing.assert_close(total, torch.tensor([1.5, 1.5, 0.0, 0.5, 0.0]))
    assert total.dtype == torch.float32


def test_import_path_and_recorded():
    rollouts = [roll("abc", reward=0.25), roll("a", reward=-1.0)]
    total, per = score(rollouts, [RewardSpec("reward_fns:length_reward", 2.0), RewardSpec("recorded")])
    torch.testing.assert_close(total, torch.tensor([6.25, 1.0]))
    assert set(per) == {"reward_fns:length_reward", "recorded"}


def test_raising_function_names_it_and_the_sample():
    rollouts = [roll("4", pid=i) for i in range(10)]
    with pytest.raises(
        RewardError, match=r"'reward_fns:fails_on_seven' raised ZeroDivisionError.*index 7, prompt id 7"
    ) as e:
        score(rollouts, [RewardSpec("reward_fns:fails_on_seven")])
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_batch_level_failure_is_reported_as_such():
    with pytest.raises(RewardError, match="no single sample fails alone"):
        score([roll("4"), roll("5")], [RewardSpec("reward_fns:fails_as_batch")])


def test_wrong_length_names_expected_and_got():
    with pytest.raises(
        RewardError, match=r"'reward_fns:one_short' returned 2 values for 3 completions; expected exactly 3"
    ):
        score([roll("4")] * 3, [RewardSpec("reward_fns:one_short")])


def test_nan_names_the_sample():
    rollouts = [roll("4", pid=i) for i in range(4)]
    with pytest.raises(RewardError, match=r"'reward_fns:nan_at_two' returned nan for sample 2 \(prompt id 2\)"):
        score(rollouts, [RewardSpec("reward_fns:nan_at_two")])


def test_missing_reference_answer_is_a_reward_error():
    with pytest.raises(RewardError, match=r"'math_answer'.*prompt id 0 has no reference answer.*index 0"):
        score([roll("#### 4", answer=None)], [RewardSpec("math_answer")])


@pytest.mark.parametrize(
    "name, match",
    [
        ("nope", "not a built-in"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("reward_fns:missing", "has no callable 'missing'"),
        ("reward_fns:NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
    ],
)
def test_bad_names(name, match):
    with pytest.raises(ValueError, match=match):
        resolve_reward(name)


def test_spec_and_score_validation():
    with pytest.raises(ValueError, match="weight=nan"):
        RewardSpec("arith", math.nan)
    with pytest.raises(ValueError, match="at least one"):
        score([roll("4")], [])
    with pytest.raises(ValueError, match="each may appear once"):
        score([roll("4")], [RewardSpec("arith"), RewardSpec("arith", 2.0)])
