"""drafter_train.engines.choose: the served settings chosen on the dev split by tokens/s measured in the engine
(scripts/served_qwen.sh's `choose` stage), from a record shaped as benchmarks.engines writes it."""

from __future__ import annotations

import json

import pytest

from drafter_train.engines.choose import choose, chose_all, chosen, main
from drafter_train.errors import ConfigError


def _row(decoder, setting, tps, label=None):
    row = {"engine": "llama.cpp", "precision": "q4_k_m", "decoder": decoder, "setting": setting, "tokens_per_s": tps}
    return dict(row, label=label) if label else row


RECORD = {"prompts": "dev", "rows": [
    _row("plain", "plain", 12.0),
    _row("free n-gram", "--spec-type ngram-simple", 14.0),
    _row("free n-gram", "--spec-type ngram-mod", 15.5),
    _row("free n-gram", "--spec-type ngram-cache", 13.0),
    _row("EAGLE-3", "--spec-type draft-eagle3 --spec-draft-n-max 1", 11.0, "e3-1"),
    _row("EAGLE-3", "--spec-type draft-eagle3 --spec-draft-n-max 2", 12.5, "e3-2"),
    _row("EAGLE-3", "--spec-type draft-eagle3 --spec-draft-n-max 3", 12.1, "e3-3"),
    _row("product", "--spec-type ngram-cache,draft-eagle3 --spec-draft-n-max 3", 30.0, "e3-3"),  # not a length row
    _row("draft model", "--spec-type draft-simple --spec-draft-n-max 1", 10.0, "ar-1"),
    _row("draft model", "--spec-type draft-simple --spec-draft-n-max 3", 9.0, "ar-3"),
]}


def test_the_fastest_length_per_drafter_and_the_fastest_ngram_mode_ahead_of_the_corpus_cache():
    chosen = choose(RECORD, ["e3", "ar"])
    assert chosen["draft_len"] == {"e3": 2, "ar": 1}  # the product row labelled e3-3 is not a length candidate
    assert chosen["ngram_mode"] == "ngram-mod"
    assert chosen["product_ngram"] == "ngram-mod,ngram-cache"
    assert chosen["tokens_per_s"]["e3-2"] == 12.5
    assert chosen["product"] == "e3"  # EAGLE-3 at length 2 beat plain (12.5 > 12.0); the AR drafter did not


def test_a_drafter_that_loses_alone_stays_out_of_the_product():
    rows = [dict(r, tokens_per_s=r["tokens_per_s"] / 2) if r.get("label", "").startswith("e3") else r
            for r in RECORD["rows"]]
    chosen = choose(dict(RECORD, rows=rows), ["e3", "ar"])
    assert chosen["draft_len"] == {"e3": 2, "ar": 1} and chosen["product"] == "lookups"
    with pytest.raises(ConfigError, match="no plain row"):
        choose(dict(RECORD, rows=[r for r in RECORD["rows"] if r["decoder"] != "plain"]), ["e3"])


def test_ngram_cache_fastest_is_not_named_twice():
    rows = [dict(r, tokens_per_s=99.0) if r["setting"] == "--spec-type ngram-cache" else r for r in RECORD["rows"]]
    assert choose(dict(RECORD, rows=rows), ["e3"])["product_ngram"] == "ngram-cache"


def test_refusals_are_one_line():
    with pytest.raises(ConfigError, match="test split is for reporting only"):
        choose(dict(RECORD, prompts="test"), ["e3"])
    with pytest.raises(ConfigError, match="no row labelled dflash-<draft length>"):
        choose(RECORD, ["dflash"])
    with pytest.raises(ConfigError, match="no free n-gram rows"):
        choose(dict(RECORD, rows=[r for r in RECORD["rows"] if r["decoder"] != "free n-gram"]), ["e3"])


def test_main_prints_the_choice(tmp_path, capsys):
    path = tmp_path / "choose.json"
    path.write_text(json.dumps(RECORD))
    assert main([str(path), "e3", "ar"]) == 0
    assert json.loads(capsys.readouterr().out)["draft_len"] == {"e3": 2, "ar": 1}
    with pytest.raises(SystemExit, match="no such file"):
        main([str(tmp_path / "missing.json"), "e3"])


CORPUS = {"prompts": "dev", "rows": [
    _row("plain", "plain", 12.0),
    _row("free n-gram", "--spec-type ngram-mod", 15.0),
    _row("product", "--spec-type ngram-mod,ngram-cache --lookup-cache-static corpus.lookup", 13.0, "lookups"),
]}


def test_the_corpus_cache_joins_the_product_only_if_it_made_the_kept_mode_faster_on_dev(tmp_path, capsys):
    """A second dev record timed the kept mode (ngram-mod) alone and with ngram-cache and the corpus cache after it:
    slower with the cache, so the product runs the mode alone; faster, and it keeps the cache."""
    chosen = choose(RECORD, ["e3", "ar"], CORPUS)
    assert chosen["corpus"] == {"mode_alone": 15.0, "with_corpus_cache": 13.0, "joins": False}
    assert chosen["product_ngram"] == "ngram-mod" and chosen["ngram_mode"] == "ngram-mod"
    faster = dict(CORPUS, rows=[dict(r, tokens_per_s=16.0) if r["decoder"] == "product" else r
                                for r in CORPUS["rows"]])
    assert choose(RECORD, ["e3"], faster)["product_ngram"] == "ngram-mod,ngram-cache"
    with pytest.raises(ConfigError, match="needs the free n-gram row of ngram-mod and the product row lookups"):
        choose(RECORD, ["e3"], dict(CORPUS, rows=CORPUS["rows"][:2]))
    with pytest.raises(ConfigError, match="test split is for reporting only"):
        choose(RECORD, ["e3"], dict(CORPUS, prompts="test"))
    for name, record in (("choose.json", RECORD), ("corpus.json", CORPUS)):
        (tmp_path / name).write_text(json.dumps(record))
    assert main([str(tmp_path / "choose.json"), "e3", "--corpus", str(tmp_path / "corpus.json")]) == 0
    assert json.loads(capsys.readouterr().out)["product_ngram"] == "ngram-mod"


def test_the_choice_names_its_machine_and_both_dev_records_must_share_it(tmp_path, capsys):
    """choice.json carries the machine its dev records were timed on (scripts/served_qwen.sh measures again on
    another CPU: journal.measured_here); a corpus record timed on another machine is refused in one line."""
    from drafter_train.engines.journal import machine_identity, measured_here
    from drafter_train.engines.journal import main as journal_main

    here, there = machine_identity(), dict(machine_identity(), cpu="Some Other CPU")
    chosen = choose(dict(RECORD, machine=here), ["e3"], dict(CORPUS, machine=here))
    assert chosen["machine"] == here
    with pytest.raises(ConfigError, match="^choose --corpus: the two dev records were measured on different machines$"):
        choose(dict(RECORD, machine=here), ["e3"], dict(CORPUS, machine=there))
    for name, machine in (("here.json", here), ("there.json", there)):
        (tmp_path / name).write_text(json.dumps(dict(chosen, machine=machine)))
    (tmp_path / "unnamed.json").write_text(json.dumps({"draft_len": {}}))
    assert measured_here(tmp_path / "here.json") is None
    assert measured_here(tmp_path / "there.json") == f"{tmp_path / 'there.json'}: measured on Some Other CPU, not " \
                                                     "this machine"
    assert measured_here(tmp_path / "unnamed.json").endswith("names no machine")
    assert measured_here(tmp_path / "missing.json").endswith("nothing measured there")
    capsys.readouterr()
    assert journal_main([str(tmp_path / "here.json")]) == 0 and capsys.readouterr().out == ""
    assert journal_main([str(tmp_path / "there.json")]) == 1 and "Some Other CPU" in capsys.readouterr().out


def test_a_mode_or_drafter_that_had_no_draft_accepted_is_not_chosen_for_a_noisy_win():
    """Seen on dev in llama.cpp: ngram-map-k4v drafted nothing (tau 1.0), yet its one round measured 19 % above plain,
    and it was kept. A row with tau 1 decoded plainly; it is chosen only when no mode had a draft accepted."""
    rows = [dict(r, tau=1.0 if "ngram-mod" in r["setting"] else 1.2) for r in RECORD["rows"] if r["decoder"] != "plain"]
    rows.append(_row("plain", "plain", 12.0))
    assert choose(dict(RECORD, rows=rows), ["e3"])["ngram_mode"] == "ngram-simple"  # ngram-mod (15.5) drafted nothing
    none = [dict(r, tau=1.0) if r["decoder"] == "free n-gram" else r for r in rows]
    assert choose(dict(RECORD, rows=none), ["e3"])["ngram_mode"] == "ngram-mod"  # then the fastest, as before
    e3_plain = [dict(r, tau=1.0) if r.get("label", "").startswith("e3") else r for r in rows]
    chosen = choose(dict(RECORD, rows=e3_plain), ["e3"])
    assert chosen["draft_len"] == {"e3": 2} and chosen["product"] == "lookups"  # 12.5 > 12.0 by noise alone


def split_record(files: dict) -> dict:
    """A verify_split record: per file its plain step and EAGLE-3's step and drafting ms at 2 and 4 tokens (JSON keys)."""
    return {"data": {"figures": {label: {"plain_ms": plain, "kinds": {"eagle3": {
        "ms": {"2": e3[0], "4": e3[1]}, "draft_ms": {"2": e3[2], "4": e3[3]}}} if e3 else {}}
        for label, (plain, e3) in files.items()}}}


def test_verify_file_choice_predicts_each_files_eagle3_against_the_fastest_plain_file():
    from drafter_train.engines.choose import verify_file_choice

    split = split_record({"q4_k_m": (70.0, None), "stock": (60.0, (90.0, 130.0, 10.0, 30.0)),
                          "cheap": (50.0, (80.0, 100.0, 10.0, 30.0))})
    got = verify_file_choice(split, [0.5, 0.5, 0.5], 1)
    # tau at one draft: 1.5; stock: (90 + 10) / 50 = 2.0 plain steps of the fastest file -> 0.75
    assert got == {"file": "cheap", "predicted": {"stock": 0.75, "cheap": round(1.5 / 1.8, 4)}}
    # three drafts (interpolated at 4 tokens measured): tau 1 + .5 + .25 + .125
    assert verify_file_choice(split, [0.5, 0.5, 0.5], 3)["predicted"]["stock"] == round(1.875 / (160 / 50), 4)
    with pytest.raises(ConfigError, match="no file with EAGLE-3 costs"):
        verify_file_choice(split_record({"q4_k_m": (70.0, None)}), [0.5], 1)


def test_a_choice_names_every_drafter_it_weighed_and_its_fields_by_path():
    choice = choose(RECORD, ["e3", "ar"])
    assert chose_all(choice, ["e3", "ar"]) and not chose_all(choice, ["e3", "ar", "df"])
    assert chosen(choice, "draft_len.e3") == 2 and chosen(choice, "ngram_mode") == "ngram-mod"
