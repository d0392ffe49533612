"""A stand-in for ``sidecar.py`` that needs no verifiers: it speaks the adapter's JSON lines and
plays the hub's part of a run over the adapter's chat endpoint the way the hub's agent does
(a streamed chat-completions request per turn, the bash tool run on ``{"command": ...}``), so
the adapter's episode logic and its one-line errors are tested in a second. The job's ``id``
picks a behaviour: ``echo`` (a working hub), ``die`` (exits before it is ready), ``silent``
(never ready), ``unknown`` (no such environment), ``crash`` (ready, then exits on a run).

Reward of an ``echo`` run: 1 when the last answer holds the task's ``word``, else 0. A run
ends when an answer makes no tool call, or after ``turns`` answers (a task field)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request

KEY_VAR = "DRIVETRAIN_VERIFIERS_API_KEY"
LOCK = threading.Lock()


def send(message: dict) -> None:
    with LOCK:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def ask(base_url: str, messages: list, tools: list) -> dict | None:
    """One streamed chat completion, parsed from its events; ``None`` when refused."""
    body = json.dumps({"model": "m", "messages": messages, "tools": tools, "stream": True})
    request = urllib.request.Request(
        f"{base_url}/chat/completions",
        data=body.encode(),
        headers={"Authorization": f"Bearer {os.environ[KEY_VAR]}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            events = response.read().decode().split("\n\n")
    except OSError:
        return None
    chunk = json.loads(events[0].removeprefix("data: "))
    assert events[1] == "data: [DONE]", events
    return chunk["choices"][0]["delta"]


TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def play(rid: int, request: dict) -> None:
    task = request["task"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": task["prompt"]},
    ]
    answer = None
    for _ in range(int(task.get("turns", 3))):
        answer = ask(request["base_url"], messages, TOOLS)
        if answer is None:  # the episode ended on the adapter's side
            break
        messages.append(answer)
        calls = answer.get("tool_calls") or []
        if not calls:
            break
        for call in calls:  # the bash tool, as the hub's chat program runs it
            command = json.loads(call["function"]["arguments"]).get("command", "")
            output = command.removeprefix("echo ") + "\n"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    said = (answer or {}).get("content") or ""
    reward = 1.0 if task["word"] in said else 0.0
    send({"id": rid, "reward": reward, "rewards": {"said_it": reward}, "metrics": {"turns": 1.0},
          "ok": True, "errors": []})  # fmt: skip


def main() -> None:
    job = json.loads(sys.stdin.readline())
    mode = job["id"]
    send({"event": "hello", "verifiers": "0.4.0", "python": "3"})
    if mode == "die":
        print("boom: the fake server fell over", file=sys.stderr, flush=True)
        sys.exit(1)
    if mode == "silent":
        time.sleep(60)
    if mode == "unknown":
        message = f"ModuleNotFoundError: taskset {mode!r} not found (tried to import {mode!r})."
        send({"event": "error", "kind": "unknown_env", "message": message})
        sys.exit(3)
    send({"event": "ready", "env_id": mode})
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "tasks":
            words = ["apple", "pear", "plum"][: request["count"]]
            send(
                {"id": request["id"], "tasks": [{"prompt": f"Say {w}.", "word": w} for w in words]}
            )
        elif request["op"] == "run" and mode == "crash":
            sys.exit(5)
        elif request["op"] == "run":
            threading.Thread(target=play, args=(request["id"], request), daemon=True).start()


if __name__ == "__main__":
    main()
