"""External corpora loaded at start-up (``--external-corpus [NAME=]PATH``, repeatable): the admin
upload's formats, tokenized with the model's tokenizer, in the local corpus before any request;
bad files stop the start-up with the file and line; a remote corpus refuses the flag."""

import json

import pytest
from engine_fixtures import engine

from corpus_service import NgramCorpus
from verifier.cli import main
from verifier.config import VerifierConfig
from verifier.draft.drafter import Drafter
from verifier.draft.external_corpora import ExternalCorpusFile, load_external_corpora
from verifier.step.sampling import SamplingParams


def test_spec_parsing():
    assert ExternalCorpusFile.parse("docs.jsonl").name == "docs" and ExternalCorpusFile.parse("docs.jsonl").fmt == "jsonl"
    f = ExternalCorpusFile.parse("code=/data/x=y.ids")
    assert (f.name, str(f.path), f.fmt) == ("code", "/data/x=y.ids", "ids")
    assert ExternalCorpusFile.parse("/data/a=b/notes.txt").name == "notes"  # '=' inside a path
    assert ExternalCorpusFile.parse("notes.md").fmt == "text"


def test_formats_load_with_the_model_tokenizer(smollm2, tmp_path):
    codec = smollm2.codec
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n\n" + json.dumps({"ids": [5, 6, 7]}) + "\n")
    (tmp_path / "b.txt").write_text("first document\nstill first\n\nsecond one\n")
    (tmp_path / "c.ids").write_text("1 2 3\n4,5\n")
    corpus = NgramCorpus(vocab_size=smollm2.model.config.vocab_size)
    loaded = load_external_corpora(corpus, [str(tmp_path / "a.jsonl"), f"notes={tmp_path / 'b.txt'}",
                                            str(tmp_path / "c.ids")], codec.tokenizer)
    assert loaded == {"a": len(codec.encode("hello world")) + 3,
                      "notes": len(codec.encode("first document\nstill first\n")) + len(codec.encode("second one\n")),
                      "c": 5}
    assert corpus.list_external_corpora() == loaded


@pytest.mark.parametrize("name,content,needle", [
    ("bad.jsonl", '{"text": "ok"}\n{"nope": 1}\n', "line 2"),
    ("bad.ids", "1 2\n3 x\n", "line 2"),
    ("big.ids", "1 2 999999\n", "token ids"),
    ("empty.txt", "\n\n", "no documents"),
])
def test_bad_files_stop_the_start_up_with_file_and_line(smollm2, tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_text(content)
    corpus = NgramCorpus(vocab_size=smollm2.model.config.vocab_size)
    with pytest.raises(ValueError, match=needle) as e:
        load_external_corpora(corpus, [str(path)], smollm2.codec.tokenizer)
    assert str(path) in str(e.value) and corpus.list_external_corpora() == {}
    with pytest.raises(ValueError, match="not a readable file"):
        load_external_corpora(corpus, [str(tmp_path / "missing.txt")], smollm2.codec.tokenizer)
    with pytest.raises(ValueError, match="distinct"):
        load_external_corpora(corpus, [f"x={path}", f"x={path}"], smollm2.codec.tokenizer)


def test_remote_corpus_refuses_the_flag_without_loading_a_model(tmp_path, capsys):
    with pytest.raises(ValueError, match="ngram-corpus upload"):
        VerifierConfig(corpus="127.0.0.1:50051", external_corpus=("docs.jsonl",))
    assert main(["serve", "--corpus", "127.0.0.1:1", "--external-corpus", str(tmp_path / "x.txt")]) == 2
    assert "ngram-corpus upload" in capsys.readouterr().err


def test_start_up_corpus_drafts_for_the_first_request(smollm2, trace_rows, tmp_path):
    """A fresh verifier whose only knowledge of the continuation is the start-up file accepts it."""
    prompt = trace_rows[1]["prompt_ids"]
    params = SamplingParams(max_tokens=16)
    plain = engine(smollm2, None).generate([prompt], params)[0]
    doc = smollm2.codec.decode(prompt + plain.output_ids)
    (tmp_path / "seen.jsonl").write_text(json.dumps({"text": doc}) + "\n")
    cold = engine(smollm2, Drafter(vocab_size=smollm2.model.config.vocab_size)).generate([prompt], params)[0]
    drafter = Drafter(vocab_size=smollm2.model.config.vocab_size)
    load_external_corpora(drafter.local, [str(tmp_path / "seen.jsonl")], smollm2.codec.tokenizer)
    warm = engine(smollm2, drafter).generate([prompt], params)[0]
    assert warm.output_ids == plain.output_ids == cold.output_ids
    assert warm.accepted_tokens >= 10 and warm.accepted_tokens > cold.accepted_tokens
