"""A new fit on an explicit logger version that already holds a run is refused, unless --overwrite_run=true."""

from __future__ import annotations

import pytest
from helpers import QUICKSTART_ARGS

from lightning_grpo.cli import main

SMALL = ["--trainer.max_steps=1", "--data.val_size=0", "--model.rl.batch_per_replica=16",
         "--model.rl.micro_batch_per_replica=16", "--trainer.enable_progress_bar=false",
         "--trainer.logger.init_args.version=0"]


@pytest.mark.slow
def test_reusing_a_version_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["fit", *QUICKSTART_ARGS, *SMALL])
    folder = tmp_path / "runs" / "quickstart" / "version_0"
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(["fit", *QUICKSTART_ARGS, *SMALL, "--seed_everything=3"])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert "version=0: runs/quickstart/version_0 already holds a run (metrics.csv, config.yaml" in err
    assert "--overwrite_run=true" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before  # untouched, no error.log
    main(["fit", *QUICKSTART_ARGS, *SMALL, "--seed_everything=3", "--overwrite_run=true"])
    assert "seed_everything: 3" in (folder / "config.yaml").read_text()  # replaced, as asked
