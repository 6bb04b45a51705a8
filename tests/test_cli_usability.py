"""The ``minicomm`` command as a new user meets it (issue 34): usage errors instead of failed
proofs, help on every option, plain-text help, the simulator's units, sizes, flags, reasons and
summaries, and the demo's progress bars, table legend and plots."""
import argparse
import io
import json
import os
import re
import sys
from contextlib import redirect_stdout

import pytest

from extras import module_missing, require
from minicomm import cli
from minicomm.algorithms import FAMILIES
from minicomm.schedule import COLLECTIVES
from minicomm.sim import cli as sim_cli
from minicomm.tools import demo

sys.path.insert(0, os.path.dirname(__file__))


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


# ------------------------------------------------------------------------------ verify
@pytest.mark.parametrize("argv, bad, choices", [
    (["verify", "--collective", "allreduse"], "allreduse", COLLECTIVES),
    (["verify", "--algorithm", "rign"], "rign", FAMILIES),
])
def test_verify_takes_a_misspelt_name_as_a_usage_error(capsys, argv, bad, choices):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"invalid choice: '{bad}'" in err
    assert all(c in err for c in choices)


def test_verify_matrix_rejects_unknown_names_instead_of_failing_cells():
    from minicomm.tools.verify import run_matrix
    out = io.StringIO()
    with pytest.raises(ValueError, match="unknown collective 'allreduse'"):
        run_matrix(2, jobs=1, collectives=["allreduse"], out=out)
    with pytest.raises(ValueError, match="unknown algorithm 'rign'"):
        run_matrix(2, jobs=1, families=["rign"], out=out)
    assert out.getvalue() == ""                    # no matrix, no "0/4 cells pass"


# ------------------------------------------------------------------------------ help
def test_every_command_has_a_description_and_every_option_help():
    parser = cli.build_parser()
    missing = []
    for name, sub in _subparsers(parser):
        if not (sub.description or "").strip():
            missing.append(f"minicomm {name}: no description")
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if not (action.help or "").strip():
                missing.append(f"minicomm {name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, "without help: " + ", ".join(missing)


def test_help_is_plain_text_without_restructuredtext_backticks():
    parser = cli.build_parser()
    texts = {"minicomm": parser.format_help()}
    texts.update({f"minicomm {n}": sub.format_help() for n, sub in _subparsers(parser)})
    bad = [name for name, text in texts.items() if "``" in text]
    assert not bad, f"double backticks in the help of {bad}"
    assert "verify" in texts["minicomm"] and "minicomm sim" in texts["minicomm sim"]


# ------------------------------------------------------------------------------ sim
def _sim(argv):
    """``minicomm sim ARGV`` in process through the real parser; its stdout."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli.main(["sim", *argv])
    assert rc == 0, buf.getvalue()
    return buf.getvalue()


def test_one_size_convention_for_every_size_option():
    # bare K/M/G and KiB/MiB/GiB are powers of 1024 (nccl-tests); KB/MB/GB powers of 1000
    for text, want in (("1G", 1 << 30), ("1GiB", 1 << 30), ("1GB", 10 ** 9), ("350GB", 350 * 10 ** 9),
                       ("64M", 64 << 20), ("64MB", 64 * 10 ** 6), ("4K", 4096), ("4kB", 4000),
                       ("512", 512), ("512B", 512), ("3.5e9", 3_500_000_000)):
        assert sim_cli.parse_size(text) == want, text
    assert sim_cli.parse_sizes("1G") == [sim_cli.parse_size("1G")]


def test_the_same_cluster_and_size_give_the_same_time_in_every_mode():
    topo = ["--topology", "dgx-h100", "--nodes", "2"]
    sweep = json.loads(_sim(topo + ["--sizes", "1G", "--algorithms", "hier", "--json"]))
    ps = json.loads(_sim(topo + ["--architecture", "ps", "--servers", "1", "--model-bytes", "1G",
                                 "--algorithms", "hier", "--json"]))
    advise = json.loads(_sim(topo + ["--advise", "--model-bytes", "1G", "--servers", "1",
                                     "--json"]))
    (t_sweep,) = [r["time_s"] for r in sweep if r["algorithm"] == "hier"]
    (t_ps,) = [r["time_s"] for r in ps if r["algorithm"] == "hier"]
    (t_adv,) = [r["time_s"] for r in advise["rows"] if r["algorithm"] == "hier"]
    assert sweep[0]["bytes"] == ps[0]["bytes"] == advise["model_bytes"] == 1 << 30
    assert t_sweep == pytest.approx(t_ps, rel=1e-9) and t_ps == pytest.approx(t_adv, rel=1e-9)


def test_sizes_are_printed_with_their_unit():
    out = _sim(["--topology", "dgx-h100", "--nodes", "2", "--sizes", "1K,1M,1G",
                "--algorithms", "ring"])
    for size in ("1 KiB", "1 MiB", "1 GiB"):
        assert re.search(rf"^\s*{size}\s", out, re.M), (size, out)
    out = _sim(["--topology", "dgx-h100", "--nodes", "2", "--architecture", "ps", "--servers", "1",
                "--model-bytes", "350MB", "--algorithms", "hier"])
    assert "350 MB" in out


@pytest.mark.parametrize("argv", [
    ["--advise", "--compare-interconnects", "--model-bytes", "1G"],
    ["--explain", "--advise", "--model-bytes", "1G"],
    ["--advise", "--architecture", "ps", "--model-bytes", "1G"],
    ["--compare-interconnects", "--architecture", "ps"],
    ["--compare-interconnects", "--plot", "x.png"],
    ["--advise", "--sizes", "1G", "--model-bytes", "1G"],
    ["--sizes", "1G", "--model-bytes", "1G"],
    ["--architecture", "ps", "--sizes", "1G", "--model-bytes", "1G"],
    ["--servers", "4"],
    ["--explain", "--sizes", "1G"],
])
def test_flags_that_do_not_go_together_are_a_usage_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(["sim", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: minicomm sim" in err and "error:" in err
    named = [f for f in argv if f.startswith("--")]
    assert sum(f in err for f in named) >= min(2, len(named)), err


def test_sim_output_defines_its_symbols_and_gives_units():
    out = _sim(["--advise", "--model-bytes", "1G", "--gpus", "64", "--topology", "dgx-h100",
                "--algorithms", "tree,rhd,hier"])
    line = next(ln for ln in out.splitlines() if ln.startswith("server-count crossover"))
    for sym in ("n = ", "M = ", "B = ", "t = ", "t_intra = "):
        assert sym in line, (sym, line)
    assert not re.search(r"busiest NIC \d+\.\d+ out", out), out
    assert "busiest link: server 0's NIC" in out or "busiest link: NVLink" in out, out
    sweep = _sim(["--topology", "dgx-h100", "--nodes", "2", "--sizes", "1G",
                  "--algorithms", "ring"])
    busiest = next(ln for ln in sweep.splitlines() if "busiest link" in ln)
    assert re.search(r"\d+(\.\d+)? (GiB|MiB|GB|MB) through it", busiest), busiest
    assert "% of the call" in busiest, busiest
    assert "busbw GB/s" in sweep


def test_every_link_of_every_preset_is_named_in_words():
    from minicomm.sim import presets
    from minicomm.sim.topology import Fabric
    from minicomm.sim.units import describe_link
    for name in presets.topologies():
        topo = presets.get_topology(name, nodes=2)
        fab = Fabric(topo)
        for i in range(len(fab)):
            words = describe_link(fab.name(i))
            assert not re.search(r"\bacc \d|NIC \d+\.\d+|^\w+ \d+$", words), (name, words)


def _advise_json(gpus, *more):
    return json.loads(_sim(["--advise", "--model-bytes", "1G", "--gpus", str(gpus),
                            "--topology", "dgx-h100", "--json", *more]))


NOT_RING = ("--algorithms", "rhd,hier")   # a ring on a channel per NIC, and NCCL's double binary
                                          # tree, beat them both


def test_advise_says_why_its_winner_flips():
    """Without the ring and tree (which, on a channel per NIC, win both cases): 64 GPUs (8 servers):
    hier, whose inter-server phase is recursive halving/doubling, is bandwidth-optimal and wins;
    56 GPUs (7 servers): 7 = 4 + 3, the 3 extra servers fold into a partner, whose NIC then
    carries (2(4-1)/4 + 1) c against the minimum 2(7-1)/7 c for a shard c — the colocated PS,
    which needs no power of two, wins. The reason is printed with that ratio."""
    assert _advise_json(64)["winner"] == _advise_json(56)["winner"] == "ring"
    out64 = _sim(["--advise", "--model-bytes", "1G", "--gpus", "64", "--topology", "dgx-h100",
                  *NOT_RING])
    out56 = _sim(["--advise", "--model-bytes", "1G", "--gpus", "56", "--topology", "dgx-h100",
                  *NOT_RING])
    assert _advise_json(64, *NOT_RING)["winner"] == "hier"
    assert _advise_json(56, *NOT_RING)["winner"].startswith("ps-colocated")
    why64 = [ln for ln in out64.splitlines() if ln.startswith("why")]
    why56 = [ln for ln in out56.splitlines() if ln.startswith("why")]
    assert why64 and why56
    assert "power of two" not in " ".join(why64)
    assert any("hier" in ln and "bandwidth-optimal" in ln for ln in why64), why64
    text56 = " ".join(why56)
    q, p2 = 7, 4                      # servers, the largest power of two below
    ratio = (2 * (p2 - 1) / p2 + 1) / (2 * (q - 1) / q)
    assert f"{q} = {p2} + {q - p2}" in text56 and "power of two" in text56, text56
    assert f"{ratio:.2f}x" in text56, (ratio, text56)


@pytest.mark.parametrize("argv", [
    ["--topology", "dgx-h100", "--nodes", "2", "--sizes", "1M,1G", "--algorithms", "ring,hier"],
    ["--topology", "dgx-h100", "--nodes", "2", "--architecture", "ps", "--servers", "1",
     "--model-bytes", "256MB"],
    ["--advise", "--model-bytes", "1G", "--gpus", "16", "--topology", "dgx-h100"],
    ["--compare-interconnects", "--topology", "dgx-h100", "--nodes", "2", "--sizes", "1M,1G",
     "--algorithms", "hier"],
    ["--explain", "--nodes", "2"],
])
def test_every_answer_ends_with_a_one_line_summary(argv):
    lines = _sim(argv).rstrip("\n").splitlines()
    assert lines[-1].startswith("Summary: "), lines[-1]
    assert sum(ln.startswith("Summary: ") for ln in lines) == 1
    summary = lines[-1]
    assert re.search(r"\d", summary) and re.search(r"\b(s|ms|us|GB|MB|TB|GiB|MiB)\b", summary), \
        summary


def test_sim_help_examples_use_the_size_convention():
    text = dict(_subparsers(cli.build_parser()))["sim"].format_help()
    assert "350GB" in text and "KiB" in text


# ------------------------------------------------------------------------------ demo
def _tqdm_frames(err, total):
    return [f for f in re.split(r"[\r\n]", err) if f"{total}/{total}" in f]


def test_progress_bar_draws_its_last_frame_once_and_labels_the_batch_loss(monkeypatch):
    """Why ps-sync's bar showed twice: its steps are slow, so tqdm redrew at the last update
    (with the loss of step 20k) and close() drew the 100% frame again (with the last loss)."""
    pytest.importorskip("tqdm")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    bar = demo.Progress("ps-sync", 5, mininterval=0.0)    # every update is slow enough to draw
    for step in range(5):
        bar(step, 1.0 / (step + 1))
    bar.close()
    frames = _tqdm_frames(err.getvalue(), 5)
    assert len(frames) == 1, frames
    assert "batch_loss=0.2000" in frames[0] and " loss=" not in frames[0]


def test_progress_plain_line_labels_the_batch_loss(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    bar = demo.Progress("single", 3)
    for step in range(3):
        bar(step, 1.0 / (step + 1))
    bar.close()
    err = capsys.readouterr().err
    assert "batch loss 0.3333" in err and len(_tqdm_frames(err, 3)) == 1


@pytest.fixture(scope="module")
def demo_doc():
    """One small real demo run (threads): single, ring, auto, ps-sync and ps-async."""
    pytest.importorskip("minicomm.ps")
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    a = p.parse_args(["--transport", "inproc", "--steps", "30", "--no-plots",
                      "--modes", "single,ring,auto,ps-sync,ps-async"])
    a.json = True                                    # no progress bars in the test's stderr
    return demo.run_demo(a, log=io.StringIO())


def test_demo_table_says_its_loss_is_over_the_training_split_and_has_a_legend(demo_doc):
    runs = demo_doc["runs"]
    table = demo.format_table(runs)
    assert "train-split loss" in table.splitlines()[0]
    legend = demo.table_legend(runs)
    assert len(legend.splitlines()) == 1
    auto = next(demo._algorithm_cell(r) for r in runs if r["algorithm"] == "auto")
    if "(" in auto:                       # auto(rhd+tree): which algorithms auto picked
        assert auto in legend
    assert "(2w/2s)" in legend and "workers" in legend and "servers" in legend
    assert "last batch" in legend


def test_demo_prints_the_legend_under_the_table(demo_doc, monkeypatch, capsys):
    monkeypatch.setattr(demo, "run_demo", lambda a, log=None, plan=None: demo_doc)
    assert demo.main(["--no-plots", "--steps", "30"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, ln in enumerate(out) if ln.startswith("mode "))
    legend_at = head + 2 + len(demo_doc["runs"])
    assert out[legend_at] == demo.table_legend(demo_doc["runs"])


def test_demo_plots_say_the_synchronous_curves_coincide_and_label_every_axis(demo_doc, tmp_path):
    require(module_missing("matplotlib", "plot"))
    runs = demo_doc["runs"]
    groups = demo.coinciding_runs(runs)
    sync = {demo._plot_label(r) for r in runs if r["mode"] in ("single", "allreduce", "ps-sync")}
    assert [set(g) for g in groups] == [sync]
    figs = demo.build_figures(runs)
    try:
        for name in ("loss_vs_step.png", "loss_vs_time.png"):
            ax = figs[name].axes[0]
            notes = [t.get_text() for t in ax.texts]
            leg = ax.get_legend()
            notes.append(leg.get_title().get_text() if leg else "")
            assert any("coincide" in t and all(s in t for s in sync) for t in notes), notes
        for name, fig in figs.items():
            ax = fig.axes[0]
            assert ax.get_xlabel() and ax.get_ylabel(), name
    finally:
        import matplotlib.pyplot as plt
        for fig in figs.values():
            plt.close(fig)
    paths = demo.write_plots(runs, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == sorted(figs)
    assert all(os.path.getsize(p) > 1000 for p in paths)
