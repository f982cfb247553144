"""The ``spotnik`` command line: status (embedded store and etcd), error handling, bench allreduce."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from helpers import free_port

from spotnik_lightning.bench import format_size, parse_size, parse_sizes
from spotnik_lightning.cli import main
from spotnik_lightning.membership import Member, Membership, open_store

SPOTNIK = Path(sys.executable).with_name("spotnik")


def _populate(url: str, run_id: str) -> None:
    """Three registered workers, two of them members of epoch 1 (c is waiting to join)."""
    a, b, c = (Member("wa", "127.0.0.1", 7001, "reliable"), Member("wb", "127.0.0.1", 7002),
               Member("wc", "127.0.0.1", 7003))
    with open_store(url, run_id) as store:
        for m in (a, b, c):
            store.register(m, timedelta(seconds=60))
        won, _ = store.cas_membership(0, Membership(1, (a, b)))
        assert won


def _check_status_json(out: str, url: str) -> None:
    st = json.loads(out)
    assert st["epoch"] == 1 and st["store"] == url and st["size"] == 2
    assert [(m["rank"], m["id"], m["address"], m["tier"], m["alive"]) for m in st["members"]] == [
        (0, "wa", "127.0.0.1:7001", "reliable", True), (1, "wb", "127.0.0.1:7002", "transient", True)]
    assert [(r["id"], r["member"]) for r in st["registered"]] == [("wa", True), ("wb", True), ("wc", False)]


def test_status_embedded(embedded_server, capsys: pytest.CaptureFixture[str]) -> None:
    url = embedded_server.url
    _populate(url, "run-e")
    assert main(["status", "--store", url, "--run-id", "run-e", "--json"]) == 0
    _check_status_json(capsys.readouterr().out, url)
    assert main(["status", "--store", url, "--run-id", "run-e"]) == 0
    text = capsys.readouterr().out
    assert "epoch 1, 2 member(s)" in text and "127.0.0.1:7002" in text and "waiting to join" in text


def test_status_empty_run(embedded_server, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--store", embedded_server.url, "--run-id", "nothing-here", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["epoch"] == 0 and st["members"] == [] and st["registered"] == []
    assert main(["status", "--store", embedded_server.url, "--run-id", "nothing-here"]) == 0
    assert "no membership committed yet" in capsys.readouterr().out


def test_status_etcd(etcd_server) -> None:
    _populate(etcd_server.url, "run-etcd")
    # through the installed console script, as a user would run it
    p = subprocess.run([str(SPOTNIK), "status", "--store", etcd_server.url, "--run-id", "run-etcd", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    _check_status_json(p.stdout, etcd_server.url)


@pytest.mark.parametrize("scheme", ["embedded://", "etcd://"])
def test_status_unreachable_store(scheme: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"{scheme}127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["status", "--store", url, "--run-id", "r", "--timeout", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("spotnik status: cannot reach the store at " + url) and "\n" not in err


def test_status_malformed_store_url(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["status", "--store", "foo://x:1", "--run-id", "r"])
    assert exc.value.code == 2
    assert "foo://x:1" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["12XB", "-1MiB", "1.5MiB", "0", "1MiB,,2", "6"])
def test_bad_size_is_a_usage_error_naming_it(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "allreduce", f"--sizes={bad}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --sizes" in err and (repr(bad) in err or repr(bad.split(",")[-1]) in err), err


def test_size_parsing() -> None:
    assert parse_size("1MiB") == 1 << 20 and parse_size("16mib") == 16 << 20
    assert parse_size("512KiB") == 512 << 10 and parse_size("1GiB") == 1 << 30 and parse_size("4096") == 4096
    assert parse_sizes("1MiB,64KiB") == [1 << 20, 64 << 10]
    assert format_size(16 << 20) == "16MiB" and format_size(1000) == "1000B"
    for bad in ("", "MiB", "1 TiB", "1e6"):
        with pytest.raises(ValueError, match="bad size"):
            parse_size(bad)


def test_bench_recovery_missing_or_delegated(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import spotnik_lightning.bench.recovery  # noqa: F401
    except ModuleNotFoundError:
        assert main(["bench", "recovery", "--anything"]) == 2
        assert "spotnik_lightning.bench.recovery is missing" in capsys.readouterr().err
        return
    # present: every argument after "bench recovery" goes to its own parser
    with pytest.raises(SystemExit) as exc:
        main(["bench", "recovery", "--help"])
    assert exc.value.code == 0
    assert "spotnik bench recovery" in capsys.readouterr().out


def test_bench_allreduce_json_smoke() -> None:
    p = subprocess.run([str(SPOTNIK), "bench", "allreduce", "--procs", "2", "--sizes", "64KiB", "--iters", "3",
                        "--rounds", "2", "--json"], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)  # exactly one JSON object on stdout
    assert out["config"]["procs"] == [2] and out["config"]["iters"] == 3
    (row,) = out["rows"]
    assert row["procs"] == 2 and row["size_bytes"] == 64 << 10 and row["size"] == "64KiB"
    for key in ("gloo_busbw_gbps", "spotnik_busbw_gbps", "ratio", "gloo_time_ms", "spotnik_time_ms",
                "rss_baseline_mib", "rss_peak_gloo_mib", "rss_peak_spotnik_mib"):
        assert isinstance(row[key], float) and row[key] > 0, (key, row)
