import pytest

from lightning_grpo.data.items import TaskItem
from lightning_grpo.data.rewards import math_answer
from lightning_grpo.data.tasks import GSM8K_TEMPLATE, ArithTask, get_task, render_gsm8k
from lightning_grpo.rollout.base import Prompt, Rollout
from lightning_grpo.tiny.tokenizer import CHARS


def test_arith_items_are_deterministic_and_correct():
    task = get_task("arith")
    items = task.items(200, seed=5)
    assert items == task.items(200, seed=5)
    assert items != task.items(200, seed=6)
    for it in items:
        a, b = it.text[:-1].split("+")
        assert it.text.endswith("=") and it.answer == str(int(a) + int(b))
        assert 0 <= int(a) <= task.max_operand and 0 <= int(b) <= task.max_operand
    assert all(c in CHARS for it in items for c in it.text + it.answer)


def test_val_split_is_held_out():
    task = ArithTask()
    train = {it.text for it in task.items(3000, seed=0)}
    val = {it.text for it in task.items(300, seed=0, split="val")}
    assert val and not train & val
    # Every pair lands in one split: together they cover the whole problem space.
    assert len(train | val) == (task.max_operand + 1) ** 2


def test_arith_small_validates_on_its_own_draw_of_the_training_distribution():
    """Held out by hash, arith_small's 36 pairs left 4 sums never trained on: val/reward stayed 0.0 all run.
    Now validation draws 64 prompts from the 32 training pairs, on a stream of its own."""
    task = get_task("arith_small")
    train, val = task.items(2000, seed=0), task.items(64, seed=0, split="val")
    assert {it.text for it in val} <= {it.text for it in train}  # the same pairs as training
    assert len({it.text for it in val}) > 20  # 64 draws over the 36 pairs: a reward that can move in 1/64 steps
    assert [it.text for it in val] != [it.text for it in train[:64]]  # not the training draw itself


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown built-in task 'sort'; known tasks: arith, arith_small"):
        get_task("sort")


def test_render_gsm8k():
    item = render_gsm8k({"question": "Tom has 3 apples and buys 5. How many?", "answer": "3 + 5 = 8\n#### 8"})
    assert item == TaskItem(GSM8K_TEMPLATE.format(prompt="Tom has 3 apples and buys 5. How many?"), "8")
    completion = Rollout(Prompt(0, [1], item.text, item.answer), [2], "3 plus 5 is 8\n#### 8", "stop")
    assert math_answer([completion]) == [1.0]
