"""usp-export's parts in one process: what a run records for export (its model config and
its data's tokenizer), model configs this usp cannot build, and the command's refusals that
need no checkpoint (one error line, exit 2, nothing written). Exports of real runs'
checkpoints: ``distributed/test_export_ranks.py``; the command after usp-prepare and usp-train:
``e2e/test_corpus_to_model.py``."""

import json
from dataclasses import asdict

import pytest

from usp.models.export import main
from usp.models.run_records import (DATA_RECORD, MODEL_CONFIG, TOKENIZER_DIR, load_data_record,
                                    load_model_config)
from usp.train.build import record_for_export

from _export_runs import MODEL, TEXT, corpus, memmap, run_cfg

pytest.importorskip("transformers")


def test_a_run_records_its_model_config_and_its_datas_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = corpus(tmp_path / "data" / "corpus")
    cfg = run_cfg(tmp_path / "run", data=memmap(tmp_path / "data" / "corpus.bin"))
    record_for_export(cfg, tmp_path / "run")
    assert load_model_config(tmp_path / "run") == cfg.model
    copy = AutoTokenizer.from_pretrained(str(tmp_path / "run" / TOKENIZER_DIR))
    assert copy(TEXT[1]).input_ids == tok(TEXT[1]).input_ids
    record_for_export(cfg, tmp_path / "run")  # a resumed run replaces the copy
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [DATA_RECORD, MODEL_CONFIG,
                                                                    TOKENIZER_DIR]
    assert load_data_record(tmp_path / "run") == {
        "kind": "memmap", "seq_len": 64, "eos_token_id": None,
        "path": str((tmp_path / "data" / "corpus.bin").resolve())}

    record_for_export(run_cfg(tmp_path / "recall"), tmp_path / "recall")  # no tokenizer
    assert sorted(p.name for p in (tmp_path / "recall").iterdir()) == [DATA_RECORD, MODEL_CONFIG]
    assert load_data_record(tmp_path / "recall")["kind"] == "recall"
    assert load_model_config(tmp_path / "nowhere") is None


@pytest.mark.parametrize("edit,needle", [
    ({"partial_rotary_factor": 0.5}, "fields this usp does not know (partial_rotary_factor)"),
    ({"rope_scaling": {"factor": 4.0}}, "model.rope_scaling={'factor': 4.0} names no rope_type"),
    ({"rope": "yarn"}, "is not a valid model config: model.rope"),
    ("{not json", "is unreadable"),
])
def test_a_model_config_this_usp_cannot_build_is_refused(tmp_path, edit, needle):
    path = tmp_path / MODEL_CONFIG
    text = edit if isinstance(edit, str) else json.dumps({**asdict(MODEL), **edit})
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_model_config(tmp_path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def _refused(capsys, argv, needle):
    assert main([str(a) for a in argv]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("usp-export: error: "), cap.err
    assert needle in lines[0], lines[0]


def test_the_command_refuses_in_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    _refused(capsys, [tmp_path / "missing", out], "missing does not exist")
    (tmp_path / "run").mkdir()
    _refused(capsys, [tmp_path / "run", out], "has no step_K")
    assert not out.exists()

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text("{}")
    _refused(capsys, [tmp_path / "run", tmp_path / "taken"], "is not an empty directory")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["config.json"]
    (tmp_path / "file").write_text("")
    _refused(capsys, [tmp_path / "run", tmp_path / "file" / "out"], "is not a writable directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "run", "taken"]
