"""``ngram-verifier serve`` flags mirror VerifierConfig fields; booleans parse as words, not as
Python's bool("false") == True, from flags and from environment variables."""

import argparse

import pytest

from verifier.config import VerifierConfig, add_config_flags, config_from_args, flag_fields, parse_bool
from verifier.draft.config import DraftConfig


def _parse(argv):
    p = argparse.ArgumentParser()
    add_config_flags(p)
    return config_from_args(p.parse_args(argv))


def test_bool_flags_and_env(monkeypatch):
    c = _parse(["--cuda-graphs", "false", "--compile", "0"])
    assert (c.cuda_graphs, c.compile, c.capture_at_start) == (False, False, True)
    e = c.engine_config()
    assert (e.cuda_graphs, e.compile, e.capture_at_start) == (False, False, True)
    monkeypatch.setenv("NGRAM_VERIFIER_CAPTURE_AT_START", "off")
    assert _parse([]).capture_at_start is False
    assert _parse([]) == VerifierConfig(capture_at_start=False)


def test_bad_bool_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        _parse(["--compile", "maybe"])
    assert "expected true/false" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bool("2")


def test_native_linear_flag():
    assert _parse([]).engine_config().native_linear == "auto"
    assert _parse(["--native-linear", "off"]).engine_config().native_linear == "off"
    with pytest.raises(ValueError, match="native_linear"):
        VerifierConfig(native_linear="fast")


def test_refill_group_flag():
    assert _parse([]).engine_config().refill_slots == 1  # max_batch 8: 8 // 8
    assert _parse(["--max-batch", "64"]).engine_config().refill_slots == 8
    assert _parse(["--max-batch", "64", "--refill-group", "2"]).engine_config().refill_slots == 2
    with pytest.raises(ValueError, match="refill_group"):
        VerifierConfig(max_batch=4, refill_group=5)


def test_draft_threads_flag(monkeypatch):
    from verifier.draft.drafter import DraftConfig, Drafter, auto_draft_threads

    assert _parse(["--draft-threads", "3"]).draft.draft_threads == 3
    assert _parse([]).draft.draft_threads == 0  # auto
    with pytest.raises(ValueError, match="draft_threads"):
        DraftConfig(draft_threads=-1)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert auto_draft_threads() == 1
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert auto_draft_threads() == 4
    assert Drafter("local", DraftConfig(draft_threads=3)).local.config.draft_threads == 3


def test_remote_ask_flags(monkeypatch):
    c = _parse(["--remote-asks", "always", "--remote-ask-min-gain", "0.05", "--remote-ask-max-interval", "8"])
    d = c.draft
    assert (d.remote_asks, d.remote_ask_min_gain, d.remote_ask_max_interval) == ("always", 0.05, 8)
    assert (d.ask_gate.min_gain, d.ask_gate.max_interval) == (0.05, 8)
    monkeypatch.setenv("NGRAM_VERIFIER_REMOTE_ASK_MAX_INTERVAL", "4")
    assert _parse([]).draft.remote_ask_max_interval == 4
    for bad in ({"remote_asks": "never"}, {"remote_ask_min_gain": 1.5}, {"remote_ask_max_interval": 0},
                {"remote_ask_window_tokens": 0}, {"remote_drafts": "eager"}, {"remote_client": "fork"},
                {"draft_timeout_s": 0}, {"corpus_timeout_s": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad)).replace("remote_ask_", "")):
            DraftConfig(**bad)


def test_draft_flags_nest_in_the_verifier_config(monkeypatch):
    """The drafting flags keep their names and environment variables; they fill VerifierConfig.draft."""
    c = _parse(["--remote-drafts", "sync", "--remote-client", "thread", "--draft-timeout-s", "0.2",
                "--corpus-timeout-s", "3"])
    assert c.draft == DraftConfig(remote_drafts="sync", remote_client="thread", draft_timeout_s=0.2,
                                  corpus_timeout_s=3.0)
    monkeypatch.setenv("NGRAM_VERIFIER_REMOTE_DRAFTS", "sync")
    assert _parse([]).draft.remote_drafts == "sync"
    assert VerifierConfig() == VerifierConfig(draft=DraftConfig())
    with pytest.raises(ValueError, match="draft: expected a DraftConfig"):
        VerifierConfig(draft={"remote_drafts": "sync"})


def test_every_serve_flag_says_what_it_does_and_what_it_takes(capsys):
    """``ngram-verifier serve --help`` describes every flag with its allowed values (field metadata)."""
    from verifier.cli import main

    for f in flag_fields(VerifierConfig):
        assert f.metadata.get("help") and f.metadata.get("allowed"), f"{f.name}: no help or allowed values"
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for f in flag_fields(VerifierConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in out and f"env NGRAM_VERIFIER_{f.name.upper()}" in out, flag
        assert " ".join(f.metadata["allowed"].split()) in out, flag
    for values in ("allowed: cpu, cuda", "allowed: float32, bfloat16, float16", "allowed: pipelined, sync",
                   "allowed: process, thread", "allowed: adaptive, always", "allowed: auto, on, off",
                   "allowed: true/false", "allowed: DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        assert values in out, values


def test_log_level_is_checked():
    assert _parse(["--log-level", "debug"]).log_level == "debug"
    with pytest.raises(ValueError, match="log_level"):
        VerifierConfig(log_level="LOUD")
