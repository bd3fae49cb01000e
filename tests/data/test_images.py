"""Image references in records: every source form, TRL's multimodal messages, and unreadable images."""

import pytest
from helpers import png

from lightning_grpo.data.images import BadImageError, describe, load_image, missing_files
from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.data.sources import PromptDataError, load_items

PART = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which color?"}]}]


def test_paths_bytes_pil_and_lists_become_references(tmp_path):
    from PIL import Image

    path = tmp_path / "a.png"
    path.write_bytes(png((28, 28)))
    pil = Image.open(path)
    rows = [{"prompt": "p0", "answer": "x", "images": str(path)},
            {"prompt": "p1", "answer": "x", "images": png((56, 28))},
            {"prompt": "p2", "answer": "x", "image": pil},  # the single-image column name works too
            {"prompt": "p3", "answer": "x", "images": [str(path), png((28, 28))]},
            {"prompt": "p4", "answer": "x"}]
    items = load_items(rows)
    assert [len(it.images) for it in items] == [1, 1, 1, 2, 0]
    assert items[0].messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "p0"}]}]
    assert items[3].messages[0]["content"][:2] == [{"type": "image"}, {"type": "image"}]
    assert items[4].messages is None  # a text row stays plain
    assert all("images" not in it.meta and "image" not in it.meta for it in items)  # references, not reward columns
    assert [load_image(r).size for it in items for r in it.images] == [(28, 28), (56, 28), (28, 28), (28, 28),
                                                                       (28, 28)]


def test_trl_messages_and_inline_qwen_parts():
    rows = [{"prompt": PART, "images": [png((28, 28))], "answer": "red"},
            {"prompt": [{"role": "user", "content": [{"type": "image", "image": png((56, 56))},
                                                     {"type": "text", "text": "and this?"}]}], "answer": "blue"}]
    items = load_items(rows)
    assert [len(it.images) for it in items] == [1, 1]
    assert items[1].messages[0]["content"][0] == {"type": "image"}  # the inline image moved to the references
    assert items[1].text == "and this?"


def test_datasets_image_column_decoded_or_not(tmp_path):
    import datasets

    path = tmp_path / "b.png"
    path.write_bytes(png((28, 56)))
    ds = datasets.Dataset.from_dict({"prompt": ["a", "b"], "answer": ["1", "2"], "image": [str(path), str(path)]})
    decoded = ds.cast_column("image", datasets.Image())
    raw = ds.cast_column("image", datasets.Image(decode=False))
    for source in (decoded, raw):
        items = load_items(source)
        assert [load_image(it.images[0]).size for it in items] == [(28, 56), (28, 56)]
    assert str(path) in describe(load_items(raw)[0].images[0])


def test_image_parts_and_images_must_pair():
    with pytest.raises(PromptDataError, match=r"row 0: the messages hold 1 image parts .* but the row has 2 images"):
        load_items([{"prompt": PART, "images": [png((28, 28)), png((28, 28))], "answer": "r"}])


def test_unreadable_image_names_record_and_path(tmp_path):
    missing, broken = tmp_path / "missing.png", tmp_path / "broken.png"
    broken.write_bytes(png((28, 28))[:40])  # a truncated PNG: the header reads, the pixels do not
    for ref in (missing, broken, b"not an image"):
        with pytest.raises(BadImageError, match=r"record id=7: cannot read image .*data.on_bad_record=skip") as err:
            load_image(str(ref) if not isinstance(ref, bytes) else ref, record_id=7)
        if not isinstance(ref, bytes):
            assert str(ref) in str(err.value)


@pytest.mark.parametrize("on_bad_record", ["error", "skip"])
def test_a_row_whose_image_file_is_missing_is_named_before_training(on_bad_record, tmp_path):
    """main trained on without a word (the row failed or was skipped only at the step that drew it)."""
    (tmp_path / "ok.png").write_bytes(png((28, 28)))
    rows = [{"prompt": "color?", "images": [str(tmp_path / name)], "answer": "red"}
            for name in ("ok.png", "ok.png", "gone.png", "ok.png")]
    dm = PromptDataModule(source=rows, val_size=0, prompts_per_step=2, on_bad_record=on_bad_record)
    says = rf"1 of 4 rows name a missing image file \(.*row 2: {tmp_path}/gone.png\)"
    if on_bad_record == "error":
        with pytest.raises(PromptDataError, match=says + ".*set data.on_bad_record=skip"):
            dm.setup("fit")
        return
    with pytest.warns(UserWarning, match=says + r"; each is skipped at the loop step that draws it"):
        dm.setup("fit")
    assert missing_files([str(tmp_path / "ok.png"), b"bytes", {"path": "gone.png", "bytes": b"x"}]) == []


def test_image_markers_in_text_place_the_images():
    """LLaVA-style text (Geometry3K: "<image>Find x.") puts each image at its marker."""
    items = load_items([{"problem": "Look: <image> and <image>. Find x.", "answer": "3",
                         "images": [png((28, 28)), png((56, 28))]}], prompt_key="problem")
    assert items[0].messages[0]["content"] == [{"type": "text", "text": "Look: "}, {"type": "image"},
                                               {"type": "text", "text": " and "}, {"type": "image"},
                                               {"type": "text", "text": ". Find x."}]
