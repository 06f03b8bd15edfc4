"""usp.launch.starter: a rank forked from a server that imported another usp than its
launcher's refuses, naming both, before it takes anything of the launcher's."""

import os

import pytest

from usp.launch import starter


def test_a_rank_refuses_a_server_that_imported_another_usp(monkeypatch):
    monkeypatch.setenv("USP_TEST_MARK", "kept")
    with pytest.raises(RuntimeError, match=r"imported usp from .* the launcher runs it from "
                                           r"/elsewhere: .*PYTHONPATH=/elsewhere"):
        starter._adopt({}, {}, "/elsewhere")
    assert os.environ["USP_TEST_MARK"] == "kept"  # the environment untouched


def test_a_rank_takes_the_launchers_environment(monkeypatch):
    monkeypatch.setenv("USP_TEST_GONE", "1")
    env = {k: v for k, v in os.environ.items() if k != "USP_TEST_GONE"} | {"USP_TEST_NEW": "2"}
    starter._adopt(env, {}, starter._usp_root())
    assert "USP_TEST_GONE" not in os.environ and os.environ["USP_TEST_NEW"] == "2"
    monkeypatch.delenv("USP_TEST_NEW")
