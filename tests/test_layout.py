"""The distribution's promises about its own layout."""

import subprocess
import sys


def test_dpmath_does_not_import_torch():
    code = "import sys, dpmath, dpmath.__main__; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_command_line_demo_runs_and_rejects_bad_input():
    ok = subprocess.run([sys.executable, "-m", "dpmath", "envelope", "--projection-dim", "4", "--dim", "8", "--grid",
                         "200"], capture_output=True, text=True)
    assert ok.returncode == 0 and "x_plus" in ok.stdout and not ok.stderr
    bad = subprocess.run([sys.executable, "-m", "dpmath", "envelope", "--projection-dim", "0"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "projection_dim must be a positive integer" in bad.stderr


def test_the_command_line_help_lists_each_subcommand_once_and_required_options_without_brackets():
    top = subprocess.run([sys.executable, "-m", "dpmath", "--help"], capture_output=True, text=True).stdout
    for name in ("envelope", "epsilon", "noise-multiplier"):
        assert sum(line.split()[:1] == [name] for line in top.splitlines()) == 1, name
    usage = subprocess.run([sys.executable, "-m", "dpmath", "epsilon", "--help"], capture_output=True, text=True).stdout
    assert "--noise-multiplier SIGMA --delta DELTA" in usage and "[--noise-multiplier" not in usage
