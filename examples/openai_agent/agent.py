"""A plain OpenAI-client agent with a calculator tool, trained by drivetrain through its endpoint.

Nothing here knows about drivetrain but two environment variables: the trainer runs this script
once per rollout step with ``DRIVETRAIN_EPISODES`` (a JSON file: ``[{"session", "base_url",
"reward_url", "task", "sample"}, ...]``) and ``OPENAI_API_KEY``; every episode is played
against its own ``base_url``. The same script runs against any OpenAI-compatible server
(``OPENAI_BASE_URL``, no ``DRIVETRAIN_EPISODES``) with a question on the command line.

For each episode: the task's ``question`` as the user message, then up to ``MAX_TURNS`` turns
of "ask the model, run the calculator calls it makes, send the results back", until it answers
without a tool call. The trainer scores the last answer (or the agent reports a reward).
"""

from __future__ import annotations

import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from openai import BadRequestError, OpenAI

MAX_TURNS = 4
#: episodes played at once: all of a step's, up to this many (each thread waits on HTTP; the
#: trainer's rollout batches whatever is in flight, so fewer threads means smaller batches)
THREADS = 256
MAX_TOKENS = 256

#: the tool as drivetrain's built-in calculator environment offers it (same schema, so a model
#: trained there calls it the same way here)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Computes one operation on two integers: a+b, a-b or a*b.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 47*83"}},
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    }
]
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
EXPRESSION = re.compile(r"\s*(-?\d{1,12})\s*([+\-*])\s*(-?\d{1,12})\s*")


def calculator(arguments: str) -> str:
    """Run one call: ``arguments`` is the model's JSON; errors are results the model reads."""
    try:
        expression = json.loads(arguments)["expression"]
    except (json.JSONDecodeError, TypeError, KeyError):
        return 'error: arguments must be {"expression": "a op b"}'
    match = EXPRESSION.fullmatch(expression) if isinstance(expression, str) else None
    if match is None:
        return f"error: {expression!r} is not one operation on two integers (a+b, a-b, a*b)"
    a, op, b = match.groups()
    return str(OPERATIONS[op](int(a), int(b)))


def play(client: OpenAI, question: str) -> str:
    """One episode; returns the model's last answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    answer = ""
    for _ in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS
            )
        except BadRequestError:  # no room for another turn (context, turn limit): done
            break
        message = reply.choices[0].message
        answer = message.content or ""
        calls = message.tool_calls or []
        assistant: dict[str, Any] = {"role": "assistant", "content": message.content}
        if calls:
            assistant["tool_calls"] = [call.model_dump() for call in calls]
        messages.append(assistant)
        if not calls:
            break
        for call in calls:
            result = calculator(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return answer


def main() -> None:
    key = os.environ.get("OPENAI_API_KEY", "none")
    path = os.environ.get("DRIVETRAIN_EPISODES")
    if path is None:  # by hand, against any OpenAI-compatible server
        question = " ".join(sys.argv[1:]) or "What is (47*83)+12?"
        print(play(OpenAI(api_key=key), question))
        return
    with open(path) as f:
        episodes = json.load(f)

    def run(episode: dict[str, Any]) -> str:
        client = OpenAI(base_url=episode["base_url"], api_key=key)
        return play(client, episode["task"]["question"])

    with ThreadPoolExecutor(max(1, min(THREADS, len(episodes)))) as pool:
        for episode, answer in zip(episodes, pool.map(run, episodes), strict=True):
            print(f"{episode['session']}: {answer!r}", file=sys.stderr)


if __name__ == "__main__":
    main()
