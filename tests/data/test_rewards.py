import copy
import math
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

from lightning_grpo.data.reward_calls import trl_arguments
from lightning_grpo.data.rewards import (
    RewardError,
    RewardSpec,
    check_reward_columns,
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


def test_failing_batch_call_raises_at_once_with_its_own_traceback():
    """No per-sample re-calls to locate the sample: one call, its exception chained (frames in reward_fns.py)."""
    import reward_fns

    reward_fns.CALLS.clear()
    with pytest.raises(RewardError, match=r"'reward_fns:counted_failure' raised KeyError: 'no_such_field'") as e:
        score([roll("4", pid=i) for i in range(64)], [RewardSpec("reward_fns:counted_failure")])
    assert reward_fns.CALLS == [64]  # main re-called it once per sample (64 extra calls) before raising
    cause = e.value.__cause__
    assert isinstance(cause, KeyError)
    assert traceback.extract_tb(cause.__traceback__)[-1].name == "counted_failure"


def test_per_sample_functions_name_the_failing_sample():
    rollouts = [roll("4", pid=i) for i in range(10)]
    with pytest.raises(RewardError, match=r"(?s)'reward_fns:fails_on_seven' raised ZeroDivisionError.*sample 7, prompt id 7"):
        score(rollouts, [RewardSpec("reward_fns:fails_on_seven", per_sample=True)])
    _, per = score(rollouts[:7], [RewardSpec("reward_fns:length_reward", per_sample=True)])
    assert per["reward_fns:length_reward"].tolist() == [1.0] * 7


@pytest.mark.parametrize(
    "name, match",
    [
        ("reward_fns:returns_strings", r"returned '1.0' \(str\) for sample 0 \(prompt id 0\); rewards must be real"),
        ("reward_fns:returns_text", r"returned a str; it must return a list of 3 numbers"),
        ("reward_fns:returns_int_keyed_dict", r"returned a dict; it must return a list of 3 numbers"),
    ],
)
def test_non_numbers_are_refused(name, match):
    """main turned '1.0' into 1.0 and trained an int-keyed dict on its keys (reward/mean 31.5)."""
    with pytest.raises(RewardError, match=match):
        score([roll("4", pid=i) for i in range(3)], [RewardSpec(name)])


def test_numpy_scalars_bools_ints_and_arrays_are_numbers():
    rollouts = [roll("4", pid=i) for i in range(5)]
    total, per = score(rollouts, [RewardSpec("reward_fns:returns_numpy"), RewardSpec("reward_fns:returns_array")])
    assert per["reward_fns:returns_numpy"].tolist() == [0.5, 1.0, 1.0, 1.0, 2.0]
    torch.testing.assert_close(total, torch.tensor([0.75, 1.25, 1.25, 1.25, 2.25]))


def test_rollouts_are_read_only_to_reward_functions():
    """A function that edits its rollouts in place changes nothing that is trained (main trained on the edits)."""
    rollouts = [Rollout(Prompt(i, [5, 6], "2+2=", "4", {"answer": "4"}), [7, 8], "4", "stop") for i in range(3)]
    before = copy.deepcopy(rollouts)
    score(rollouts, [RewardSpec("reward_fns:edits_in_place"), RewardSpec("reward_fns:trl_edits_in_place")])
    assert rollouts == before


def test_a_hung_function_ends_at_its_timeout_naming_it():
    import reward_fns

    reward_fns.RELEASE.clear()
    start = time.monotonic()
    try:
        with pytest.raises(RewardError, match=r"'reward_fns:hangs' did not return within timeout_s=0.5 s on a batch"):
            score([roll("4"), roll("5")], [RewardSpec("reward_fns:hangs", timeout_s=0.5)])
    finally:
        reward_fns.RELEASE.set()  # let the abandoned daemon thread finish
    assert time.monotonic() - start < 3


def test_a_stop_request_abandons_a_running_call():
    import reward_fns

    reward_fns.RELEASE.clear()
    requested = time.monotonic() + 0.3
    try:
        with pytest.raises(RewardError, match=r"'reward_fns:hangs' was still running.*asked to stop \(SIGTERM\)"):
            score([roll("4")], [RewardSpec("reward_fns:hangs", timeout_s=600)],
                  should_stop=lambda: time.monotonic() > requested)
    finally:
        reward_fns.RELEASE.set()
    assert time.monotonic() - requested < 2


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
    with pytest.raises(RewardError, match=r"'math_answer' raised ValueError: prompt id 0 has no reference answer"):
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


# -- TRL-style functions ------------------------------------------------------------------------------------------


def test_signature_is_detected_once_at_config_load():
    assert RewardSpec("reward_fns:trl_exact").function.style == "trl"
    assert RewardSpec("reward_fns:length_reward").function.style == "rollouts"
    assert RewardSpec("arith").function.style == "rollouts"
    with pytest.raises(ValueError, match=r"reward 'reward_fns:unsupported': unsupported signature "
                                         r"unsupported\(first, second\)\. Write fn\(rollouts\).*fn\(prompts, completions"):
        RewardSpec("reward_fns:unsupported")
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_module_xyz'.*working folder"):
        RewardSpec("no_such_module_xyz:f")
    with pytest.raises(ValueError, match=r"timeout_s=0 must be > 0"):
        RewardSpec("arith", timeout_s=0)


def test_functions_import_from_the_working_folder(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_cwd.py").write_text("def short(prompts, completions, **kw):\n"
                                                "    return [float(len(c) < 3) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    _, per = score([roll("4"), roll("4444")], [RewardSpec("my_rewards_cwd:short")])
    assert per["my_rewards_cwd:short"].tolist() == [1.0, 0.0]


def test_trl_functions_get_prompts_completions_and_the_dataset_columns():
    rollouts = [Rollout(Prompt(i, [5], "2+2=", "4", {"answer": a, "source_index": i, "epoch": 0}), [7], text, "stop")
                for i, (a, text) in enumerate([("4", "4"), ("5", " 5 "), ("6", "7")])]
    _, per = score(rollouts, [RewardSpec("reward_fns:trl_exact")])
    assert per["reward_fns:trl_exact"].tolist() == [1.0, 1.0, 0.0]
    kwargs = trl_arguments(RewardSpec("reward_fns:trl_exact").function, rollouts)
    assert kwargs["prompts"] == ["2+2="] * 3 and kwargs["completions"] == ["4", " 5 ", "7"]
    assert kwargs["answer"] == ["4", "5", "6"] and kwargs["completion_ids"] == [[7]] * 3
    assert "source_index" not in kwargs and "epoch" not in kwargs  # the stream's own keys are no columns


def test_conversational_prompts_give_chat_message_completions():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]
    rollouts = [Rollout(Prompt(0, [5], "user: 2+2=\nassistant: ", "4", {}, messages), [7], "4", "stop")]
    _, per = score(rollouts, [RewardSpec("reward_fns:trl_chat")])
    assert per["reward_fns:trl_chat"].tolist() == [1.0]


def test_none_is_no_opinion():
    rollouts = [roll("4", pid=i) for i in range(4)]
    with pytest.warns(UserWarning, match="2 of 4 completions got None from every reward function"):
        total, per = score(rollouts, [RewardSpec("reward_fns:trl_no_opinion_on_odd", weight=2.0)])
    values = per["reward_fns:trl_no_opinion_on_odd"]
    assert values.isnan().tolist() == [False, True, False, True]
    assert total.tolist() == [2.0, 0.0, 2.0, 0.0]  # None counts 0 in the total
    total, _ = score(rollouts, [RewardSpec("reward_fns:trl_no_opinion_on_odd"), RewardSpec("arith")])
    assert total.tolist() == [2.0, 1.0, 2.0, 1.0]


def test_required_keywords_must_be_columns():
    spec = RewardSpec("reward_fns:trl_needs_difficulty")
    check_reward_columns([spec], {"answer", "difficulty"})
    with pytest.raises(ValueError, match=r"reward 'reward_fns:trl_needs_difficulty' requires \['difficulty'\], which "
                                         r"are not columns of the prompt data \(its columns: \['answer'\]\)"):
        check_reward_columns([spec], {"answer"})


def test_math_answer_uses_math_verify_where_installed(monkeypatch):
    pytest.importorskip("math_verify")
    assert math_answer([roll("#### 0.5", "\\frac{1}{2}"), roll("\\boxed{1/2}", "#### 0.5")]) == [1.0, 1.0]
    monkeypatch.setitem(sys.modules, "math_verify", None)  # not installed: the string check alone decides
    assert math_answer([roll("#### 0.5", "\\frac{1}{2}"), roll("#### 42.0", "42")]) == [0.0, 1.0]


STUCK = '''
import pathlib
import time


def stuck(rollouts):
    pathlib.Path("entered").touch()
    while True:  # a hung call that even swallows the exceptions a signal handler could raise in it
        try:
            time.sleep(0.05)
        except BaseException:
            pass
'''


@pytest.mark.slow
def test_sigterm_is_not_held_by_a_hung_reward_function(tmp_path):
    """A real SIGTERM to a `lightning-grpo fit` whose reward hangs: the run ends in seconds, naming the function
    (main's reward ran on the training thread, so Lightning's SIGTERM flag was never read: 10+ minutes)."""
    (tmp_path / "stuck_rewards.py").write_text(STUCK)  # a user's module in the working folder
    cli = Path(sys.executable).parent / "lightning-grpo"
    args = [str(cli), "fit", "--model.policy.path=tiny:default", "--trainer.accelerator=cpu", "--trainer.max_steps=2",
            "--model.rl.batch_per_replica=4", "--model.rl.group_size=2", "--model.rollout.max_new_tokens=2",
            '--model.rewards=[{"name": "stuck_rewards:stuck", "timeout_s": 600}]', "--data.val_size=0",
            "--trainer.enable_checkpointing=false", "--trainer.logger=false"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "entered").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - sent < 15
    assert proc.returncode != 0
    assert "reward function 'stuck_rewards:stuck' was still running" in out and "(SIGTERM)" in out
