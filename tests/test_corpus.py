"""make-prompts at scale: prose kinds and code languages are worded and fenced right, held-out sources never reach
the training set (not even as a copy), a seed gives the same bytes, compressed files read back, and a source
missing on the machine is a line in the log, not a traceback. Everything runs on tiny folders made here."""

from __future__ import annotations

import io
import json
import lzma
import shutil
from pathlib import Path

import pytest

from treeserve.cli import main
from treeserve.drafter.training import corpus
from treeserve.drafter.training import corpus_sources as S
from treeserve.errors import TreeserveError
from treeserve.prompt_sets import read_prompts, write_prompts

RST = """Spinning widgets
================

A widget spins when its ``spin()`` method is called. The speed is set by
``WIDGET_SPEED`` and may be changed at any time while the widget runs.
Each turn of a widget is counted, and the count can be read back later.

Stopping
--------

Call ``stop()`` to stop the widget. A stopped widget keeps its count until
it is reset. Stopping a widget that does not spin does nothing at all.
"""


def prose(paragraphs: int) -> str:
    return "\n".join(RST.replace("widget", f"widget{i}") for i in range(paragraphs))


def code_file(language: str, units: int) -> str:
    unit = {"c": "int add{i}(int a, int b)\n{{\n    int total = a + b;\n    total *= {i};\n    return total;\n}}\n",
            "javascript": "function add{i}(a, b) {{\n  const total = a + b;\n  return total * {i};\n}}\n",
            "perl": "sub add{i} {{\n    my ($a, $b) = @_;\n    my $total = $a + $b;\n    return $total * {i};\n}}\n",
            "sh": "add{i}() {{\n    local total=$(( $1 + $2 ))\n    echo $(( total * {i} ))\n}}\n"}[language]
    return "\n".join(unit.format(i=i) for i in range(units))


@pytest.fixture
def trees(tmp_path):
    """train/ (docs and code in four languages), held/ (a package kept out, and its docs), and in train/ a copy
    of held/'s module under another name."""
    train, held = tmp_path / "train", tmp_path / "held"
    (train / "docs").mkdir(parents=True)
    (held / "docs").mkdir(parents=True)
    (held / "docs" / "gadgets.rst").write_text(prose(10).replace("widget", "gadget"))
    (train / "docs" / "widgets.rst").write_text(prose(30))
    (train / "docs" / "guide.md").write_text(prose(10).replace("================", "").replace("Spinning", "# Spinning"))
    for suffix, language in ((".c", "c"), (".js", "javascript"), (".pm", "perl"), (".sh", "sh")):
        (train / f"code{suffix}").write_text(code_file(language, 12))
    held_code = "\n\n".join(f"def held_out_function_{i}(first_argument, second_argument):\n"
                            f"    combined_value_of_both = first_argument * {i} + second_argument\n"
                            f"    another_distinct_line_here = combined_value_of_both - {i}\n"
                            f"    return another_distinct_line_here\n" for i in range(15))
    (held / "secret.py").write_text(held_code)
    (train / "_copied.py").write_text(held_code)  # not a vendor folder: only the line check can catch it
    return train, held


def sources(train: Path, held: Path) -> tuple:
    return (S.Source("docs", S.TRAIN, S.Folder(train), "CC0-1.0"),
            S.Source("held-code", S.HELD_OUT_CODE, S.Folder(held, include=("*.py",)), "MIT"),
            S.Source("held-docs", S.HELD_OUT_PROSE, S.Folder(held / "docs"), "CC0-1.0"),
            S.Source("gone", S.TRAIN, S.PythonPackage("no_such_package_here", "no-such-package"), "MIT"))


def read_jsonl(path: Path) -> list[dict]:
    return read_prompts(path)


def test_prose_kinds_and_code_fences(trees):
    train, _ = trees
    build = S.build_set([S.Source("docs", S.TRAIN, S.Folder(train), "CC0-1.0")], 10_000, log=io.StringIO())
    kinds = {r["kind"] for r in build.prompts}
    assert set(corpus.PROSE_KINDS) <= kinds and {"explain", "continue"} <= kinds
    for record in build.prompts:
        assert set(record) == {"prompt", "chat", "kind", "source", "licence"} and record["chat"] is True
        assert record["licence"] == "CC0-1.0" and record["source"].startswith("docs/")
        label, lines = record["source"].rsplit(":", 1)
        first, last = map(int, lines.split("-"))
        assert 1 <= first < last and last - first + 1 <= corpus.MAX_LINES + 1
        fences = {".c": "c", ".js": "javascript", ".pm": "perl", ".sh": "sh", ".py": "python"}
        fence = f"```{fences[Path(label).suffix]}\n" if Path(label).suffix in fences else None
        if fence:
            assert fence in record["prompt"] and record["prompt"].endswith("\n```")
        else:
            assert record["kind"] in corpus.PROSE_KINDS and "```" not in record["prompt"]
    questions = [r["prompt"] for r in build.prompts if r["kind"] == "question"]
    asked = "\n".join(questions)
    assert any(f"about {topic}" in asked for topic in ("stopping", "`stop()`", "`spin()`", "`WIDGET_SPEED`",
                                                       "spinning widgets"))
    assert all(any(q.format(topic="")[:12] in p for q in corpus.TOPIC_QUESTIONS + corpus.GENERIC_QUESTIONS)
               for p in questions)


def test_headings_and_key_terms():
    lines = RST.splitlines()
    assert [text for _, text in corpus.headings(lines, "rst")] == ["Spinning widgets", "Stopping"]
    page = ["NAME", "       spin - turn a widget", "", "DESCRIPTION", "   Speed", "       Fast."]
    found = corpus.headings(page, "indented")
    assert [t for _, t in found] == ["NAME", "DESCRIPTION", "Speed"]
    assert corpus.document_title(page, "indented", found) == "spin"
    assert corpus.key_term("Call ``stop()`` or stop() or ``stop()``, not --force.") == "`stop()`"
    assert corpus.clean_heading(":mod:`json` --- JSON encoder") == "json --- JSON encoder"


def test_held_out_sources_never_reach_training(trees, tmp_path, monkeypatch, capsys):
    train, held = trees
    monkeypatch.setattr(S, "SOURCES", sources(train, held))
    out = tmp_path / "out" / "train.jsonl.xz"
    assert main(["make-prompts", "--preset", "all", "--out", str(out), "--held-out-dir", str(tmp_path / "held-sets")]) == 0
    training = read_jsonl(out)
    held_code = read_jsonl(tmp_path / "held-sets" / S.HELD_OUT_FILES[S.HELD_OUT_CODE])
    held_prose = read_jsonl(tmp_path / "held-sets" / S.HELD_OUT_FILES[S.HELD_OUT_PROSE])
    assert held_code and all(r["source"].startswith("held-code/") for r in held_code)
    assert held_prose and all(r["source"].startswith("held-docs/") for r in held_prose)
    assert all(r["source"].startswith("docs/") for r in training)
    # The copy of the held-out module inside train/ is read but its snippets are dropped.
    assert not any("held_out_function" in r["prompt"] or "gadget" in r["prompt"] for r in training)
    summary = json.loads((out.parent / "train.summary.json").read_text())
    assert summary["sources"]["docs"]["mostly_held_out"] > 0 and summary["prompts"] == len(training)
    assert summary["skipped"]["gone"].startswith("Python package no_such_package_here is not installed")
    assert summary["licences"] == {"CC0-1.0": len(training)}
    assert "skipped gone: Python package no_such_package_here is not installed" in capsys.readouterr().err


def test_same_seed_same_bytes(trees, tmp_path, monkeypatch):
    train, held = trees
    monkeypatch.setattr(S, "SOURCES", sources(train, held))
    outs = [tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz", tmp_path / "c.jsonl.gz"]
    for out, seed in zip(outs, (5, 5, 6)):
        assert main(["make-prompts", "--preset", "training", "--out", str(out), "--seed", str(seed)]) == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()  # gzip without a timestamp
    assert read_jsonl(outs[0]) != read_jsonl(outs[2])


@pytest.mark.parametrize("name", ["p.jsonl", "p.jsonl.gz", "p.jsonl.xz"])
def test_compressed_round_trip(tmp_path, name):
    records = [{"prompt": f"prompt {i} \u00e9\n", "chat": i % 2 == 0, "kind": "explain", "source": "x:1-2",
                "licence": "MIT"} for i in range(5)]
    write_prompts(tmp_path / name, records)
    assert read_prompts(tmp_path / name) == records
    if name.endswith(".xz"):
        assert lzma.decompress((tmp_path / name).read_bytes()).decode().count("\n") == 5


def test_a_broken_compressed_file_is_one_error(tmp_path):
    (tmp_path / "bad.jsonl.xz").write_bytes(b"not xz at all")
    with pytest.raises(TreeserveError, match="cannot read"):
        read_prompts(tmp_path / "bad.jsonl.xz")


def test_missing_sources_are_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(S, "NPM_FOLDERS", (tmp_path / "node_modules",))
    missing = (S.Source("gone-py", S.TRAIN, S.PythonPackage("no_such_package_here", "nope"), "MIT"),
               S.Source("gone-deb", S.TRAIN, S.DebianPackage("no-such-debian-package-here", ("/usr/*",)), "MIT"),
               S.Source("gone-npm", S.TRAIN, S.NpmPackage("no-such-npm-package", "1.0.0"), "MIT"),
               S.Source("gone-sdist", S.TRAIN, S.PypiSdist("nothing", "0.1", "docs"), "MIT"))
    monkeypatch.setattr(S, "SOURCES", missing)
    assert main(["make-prompts", "--preset", "training", "--out", str(tmp_path / "t.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: no prompts for training" in err
    for name in ("gone-py", "gone-deb", "gone-npm", "gone-sdist"):
        assert f"make-prompts: skipped {name}: " in err
    assert "apt-get install no-such-debian-package-here" in err or "dpkg-query not found" in err
    assert "npm install --prefix" in err and "pip install nope" in err
    assert main(["make-prompts", "--sources", "nothing-like-this", "--out", str(tmp_path / "t.jsonl")]) == 1
    assert "unknown sources: nothing-like-this" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff renders manual pages")
def test_manual_pages_render_to_prose(tmp_path):
    body = "\n".join(f"Widget number {i} spins quickly and stops when it is told to stop, as every widget does."
                     for i in range(40))
    page = tmp_path / "man1" / "spin.1"
    page.parent.mkdir()
    page.write_text(f'.TH SPIN 1\n.SH NAME\nspin \\- turn a widget\n.SH DESCRIPTION\n{body}\n.SS Speed\n{body}\n')
    (tmp_path / "man1" / "twirl.1").write_text(".so man1/spin.1\n")
    source = S.Source("man-test", S.TRAIN, S.Folder(tmp_path, include=("*.1",)), "MIT", man=True)
    where, documents = S.source_documents(source)
    assert [d.label for d in documents] == ["man-test/man1/spin.1"]  # the .so page only includes another
    text = documents[0].text
    assert "NAME" in text and "spin - turn a widget" in text and "SPIN(1)" not in text
    prompts = corpus.document_prompts(documents[0], seed=0, per_file=8)
    assert prompts and all(r["kind"] in corpus.PROSE_KINDS for r, _ in prompts)


def test_listing_and_install_commands(capsys):
    assert main(["make-prompts", "--list-sources"]) == 0
    listing = capsys.readouterr().out
    assert all(s.name in listing for s in S.SOURCES)
    assert main(["make-prompts", "--install-commands"]) == 0
    commands = capsys.readouterr().out.splitlines()
    assert commands[0].startswith("apt-get install") and "manpages-dev" in commands[0]
    assert any(c.startswith("npm install") for c in commands) and any(" -m pip download " in c for c in commands)
    names = [s.name for s in S.SOURCES]
    assert len(names) == len(set(names)) and all(s.licence for s in S.SOURCES)


def test_licence_headers_and_tables_make_no_snippets():
    assert corpus.licence_header_end(["# Copyright 2020 Somebody", "# Licensed under MIT", "", "import os"]) == 3
    assert corpus.licence_header_end(["/* Copyright (C) Somebody.", "   Free software; see the licence.", " */",
                                      "int x;"]) == 3
    assert corpus.licence_header_end(["# A helper module", "import os"]) == 0
    table = [f"    '\\x{i:02x}',  # code {i}" for i in range(20)]
    assert all(map(corpus.data_line, table)) and not corpus.substantial(table, prose=False)
    assert corpus.substantial([f"value_{i} = compute({i})" for i in range(20)], prose=False)


def test_snippets_stay_short():
    lines = [f"line {i} " + "x" * 300 for i in range(30)]
    assert len(corpus.cut(lines, 1, 30)) <= corpus.MAX_SNIPPET_CHARS and corpus.cut(lines, 1, 30).endswith("x")
    assert corpus.cut(["y" * 10_000] + lines, 1, 30) == ""  # one minified line: nothing to cut at


WORDNET = {  # a few synsets in WordNet's database layout (wndb(5)): offset, lexicographer file, words, pointers
    "data.noun": ["  1 license text lines start with two spaces",
                  "00000001 05 n 01 dog 0 001 @ 00000003 n 0000 | a domesticated canine",
                  "00000002 05 n 01 wolf 0 001 @ 00000003 n 0000 | a wild canine that hunts in packs",
                  "00000003 05 n 01 canine 0 003 ~ 00000001 n 0000 ~ 00000002 n 0000 ~ 00000004 n 0000 | a mammal",
                  "00000004 05 n 01 fox 0 001 @ 00000003 n 0000 | a small wild canine with a bushy tail",
                  "00000005 13 n 01 pasta 0 000 | dough made of flour and water",
                  "00000006 06 n 01 dog 0 000 | a hinged catch that fits into a notch",
                  "00000007 15 n 01 Paris 0 001 @i 00000008 n 0000 | the capital of France",
                  "00000008 15 n 01 city 0 000 | a large town",
                  "00000009 26 n 01 obscurity 0 000 | a state of being unknown"],
    "index.noun": ["  1 license", "canine n 1 1 ~ 1 1 00000003", "city n 1 0 1 1 00000008",
                   "dog n 2 1 @ 2 3 00000001 00000006", "fox n 1 1 @ 1 1 00000004", "obscurity n 1 0 1 0 00000009",
                   "paris n 1 1 @ 1 1 00000007", "pasta n 1 0 1 1 00000005", "wolf n 1 1 @ 1 1 00000002"],
    "data.verb": ["00000010 32 v 01 bark 0 000 01 + 02 00 | make barking sounds; \"the dogs barked\""],
    "index.verb": ["bark v 1 0 1 1 00000010"],
    "data.adj": ["00000011 00 a 01 quick 0 001 ! 00000012 a 0101 | moving fast",
                 "00000012 00 a 01 slow 0 001 ! 00000011 a 0101 | not moving fast"],
    "index.adj": ["quick a 1 1 ! 1 1 00000011", "slow a 1 1 ! 1 1 00000012"],
}


def wordnet_source(tmp_path: Path) -> S.Source:
    folder = tmp_path / "wordnet"
    folder.mkdir()
    for name, lines in WORDNET.items():
        (folder / name).write_text("\n".join(lines) + "\n")
    return S.Source("wordnet-chat", S.TRAIN, S.Folder(folder, include=("data.*", "index.*")), "WordNet-3.0",
                    topics=True)


def test_chat_topics_ask_about_common_words_only(tmp_path):
    """Only a word's first sense, only words WordNet's corpus saw, never a word of the held-out chat prompts
    ("pasta"); comparisons take a sibling under the same hypernym, lists a hypernym's hyponyms."""
    source = wordnet_source(tmp_path)
    build = S.build_set([source], 1000, seed=0, log=io.StringIO())
    by_synset: dict[str, list[dict]] = {}
    for record in build.prompts:
        by_synset.setdefault(record["source"].split(":")[1], []).append(record)
        assert record["chat"] is True and record["licence"] == "WordNet-3.0"
        assert record["source"].startswith("wordnet-chat/")
    assert set(by_synset) == {"00000001", "00000002", "00000003", "00000004", "00000007", "00000008", "00000010",
                              "00000011", "00000012"}
    assert not any("pasta" in r["prompt"] or "catch" in r["prompt"] for r in build.prompts)
    compare = [r["prompt"] for r in by_synset["00000001"] if r["kind"] == "compare"]
    assert len(compare) == 1 and ("wolf" in compare[0] or "fox" in compare[0])
    assert any(r["kind"] == "list" and "canine" in r["prompt"] for r in by_synset["00000003"])
    assert all("Paris" in r["prompt"] for r in by_synset["00000007"])
    assert any(r["kind"] == "compare" and "slow" in r["prompt"] for r in by_synset["00000011"])
    assert all("bark" in r["prompt"] for r in by_synset["00000010"])
    assert build.sources["wordnet-chat"]["files"] == 6
    again = S.build_set([source], 1000, seed=0, log=io.StringIO())
    assert again.prompts == build.prompts
    assert S.build_set([source], 1000, seed=1, log=io.StringIO()).prompts != build.prompts
