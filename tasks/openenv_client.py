"""OpenEnv environments over their server's WebSocket protocol (openenv-core's `/ws`: `reset`, `step`, `state`
messages, one environment instance per connection): `--task openenv:http://host:port` for a running server,
`--task openenv:my_env.py:MyEnvironment` for one this run starts per rank (tasks/openenv_launch.py).

Sessions: each rank opens, before any model loads, as many sessions as it runs episodes at once (a training step's
rows, or its share of an evaluation); a server that refuses one (openenv's CAPACITY_REACHED: many environments allow
one session, `SUPPORTS_CONCURRENT_SESSIONS = False`) stops the run with a message naming the server's limit and the
episodes per rank. An episode takes a free session and gives it back when it ends: sessions are reused across steps,
each episode starting with `reset(seed=its start seed, **its row)`.

Text environments: the model's turn is the action's text field (--env-action-field, by default the action schema's
only text field), the observation's text field is the reply (--env-observation-field, likewise), the reset's is the
prompt; rewards are summed, `done` ends the episode. MCP tool environments (an action schema of openenv's
CallToolAction or bare Action): the server's tools (`list_tools`) are the model's tools, described by the chat
template; a turn's call (Hermes format, tasks/tools.py) is a `call_tool` step whose result is the reply; a turn that
calls none is the answer and ends the episode.

Every message waits at most --env-time-limit-s. A dropped connection is reconnected: a fresh session is reset with
the episode's seed and row and replays the episode's actions, and the episode goes on where it was when every replayed
response equals the one recorded (a seeded, deterministic environment), so the bits do not change; else the episode
ends (episode/failed_connection). A step past its limit ends the episode (episode/failed_timeout), as does an error
the server reports for a step (episode/failed_error); a reset that fails stops the run."""

import atexit
import json
import threading
import urllib.request
from dataclasses import replace

from tasks.adapters import AdapterTask, EnvOptions, warn_once
from tasks.base import Environment, Example, TaskError
from tasks.tools import MAX_REPLY_CHARS, hermes_call

RECONNECTS = 2  # fresh sessions tried for one call before its episode ends
REFUSALS = ("CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR")  # a session the server did not open


class ServerError(Exception):
    """An error message of the server: its code (openenv's WSErrorCode) and data."""

    def __init__(self, data: dict) -> None:
        super().__init__(f"{data.get('message', 'no message')} ({data.get('code', 'no code')})")
        self.code, self.data = data.get("code"), data


class Diverged(Exception):
    """A replayed episode answered otherwise on a fresh session: it cannot go on as it was."""


class ConnectionLost(Exception):
    """The connection dropped on every fresh session tried for one call."""


class Session:
    """One WebSocket connection to the server: one environment instance there, every message bounded in time."""

    def __init__(self, url: str, time_limit_s: float) -> None:
        from websockets.sync.client import connect

        local = url.split("://", 1)[-1].startswith(("127.0.0.1", "localhost"))
        self.time_limit_s = time_limit_s
        self.connection = connect(url.replace("http", "ws", 1) + "/ws", open_timeout=time_limit_s,
                                  close_timeout=1.0, max_size=2**27, proxy=None if local else True, legacy=True)
        from websockets.exceptions import ConnectionClosed

        try:  # the server makes the session's environment on connecting, or sends why not and closes
            try:
                self.connection.send(json.dumps({"type": "state"}))
            except ConnectionClosed:  # closed already: the refusal is waiting to be read
                pass
            answer = json.loads(self.connection.recv(timeout=time_limit_s))
        except Exception:
            self.close()
            raise
        if answer.get("type") == "error" and answer.get("data", {}).get("code") in REFUSALS:
            self.close()
            raise ServerError(answer["data"])

    def request(self, kind: str, data: dict | None = None) -> dict:
        """One message and its answer's data; ServerError for an error message, TimeoutError past the limit, and
        websockets' ConnectionClosed or OSError for a dropped connection."""
        message = {"type": kind} if data is None else {"type": kind, "data": data}
        self.connection.send(json.dumps(message))
        answer = json.loads(self.connection.recv(timeout=self.time_limit_s))
        if answer.get("type") == "error":
            raise ServerError(answer.get("data", {}))
        return answer.get("data", {})

    def close(self) -> None:
        try:
            self.connection.close()
        except Exception:  # a connection that is gone already
            pass


class SessionPool:
    """This rank's sessions: opened at start (the capacity check), taken by an episode, given back at its end."""

    def __init__(self, url: str, time_limit_s: float) -> None:
        self.url, self.time_limit_s = url, time_limit_s
        self.idle: list[Session] = []
        self.lock = threading.Lock()

    def open(self, count: int) -> None:
        self.idle += [Session(self.url, self.time_limit_s) for _ in range(count)]

    def take(self) -> Session:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        return Session(self.url, self.time_limit_s)

    def give_back(self, session: Session) -> None:
        with self.lock:
            self.idle.append(session)

    def close(self) -> None:
        with self.lock:
            sessions, self.idle = self.idle, []
        for session in sessions:
            session.close()


def get_json(url: str, time_limit_s: float) -> dict:
    with urllib.request.urlopen(url, timeout=time_limit_s) as response:
        return json.loads(response.read())


def text_field(schema: dict, chosen: str | None, kind: str, flag: str, ignored: tuple[str, ...]) -> str:
    """The text field of an action or observation schema: `chosen` (checked), else its only string property."""
    properties = {name: spec for name, spec in schema.get("properties", {}).items() if name not in ignored}
    texts = [name for name, spec in properties.items()
             if spec.get("type") == "string" or any(s.get("type") == "string" for s in spec.get("anyOf", []))]
    if chosen is not None:
        if chosen not in properties:
            raise TaskError(f"the server's {kind} has no field {chosen!r} ({flag}); its fields: {sorted(properties)}")
        return chosen
    if len(texts) != 1:
        raise TaskError(f"the server's {kind} has {len(texts)} text fields {texts} (of {sorted(properties)}): name "
                        f"the one the model's text goes to or comes from with {flag}")
    return texts[0]


def result_text(result: object) -> str:
    """An MCP tool result as text: its text contents joined (fastmcp's CallToolResult), else its data, else itself."""
    if isinstance(result, dict):
        texts = [c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict) and "text" in c]
        if texts:
            return "\n".join(texts)
        if result.get("data") is not None:
            return str(result["data"])
    return "" if result is None else str(result)


class OpenEnvTask(AdapterTask):
    """Episodes on an OpenEnv server (the module docstring): `target` is its URL, or `file.py:Class` to launch."""

    def __init__(self, target: str, options: EnvOptions | None = None) -> None:
        super().__init__(options)
        limit, sessions = self.options.time_limit_s, self.options.episodes_at_once(len(self.test))
        self.launched = None if "://" in target else target
        if self.launched is not None:
            from tasks.loading import user_class
            from tasks.openenv_launch import LaunchedServer, check_environment_class

            location, _, name = target.rpartition(":")
            check_environment_class(user_class(location, name), target, sessions,
                                    self.options.explain_episodes(len(self.test)))
            self.server = LaunchedServer(location, name, sessions, limit)
            target = self.server.url
        self.url = target.rstrip("/")
        try:
            self.metadata = get_json(f"{self.url}/metadata", limit)
            schema = get_json(f"{self.url}/schema", limit)
        except (OSError, ValueError) as error:
            raise TaskError(f"cannot reach the OpenEnv server at {self.url} ({error})") from error
        action = set(schema["action"].get("properties", {})) - {"metadata"}
        self.tools_mode = "tool_name" in action or not action  # CallToolAction, or the bare Action of an MCP server
        self.action_field = None if self.tools_mode else text_field(
            schema["action"], self.options.action_field, "action", "--env-action-field", ("metadata",))
        self.observation_field = None if self.tools_mode else text_field(
            schema["observation"], self.options.observation_field, "observation", "--env-observation-field",
            ("metadata", "reward", "done"))
        self.pool = SessionPool(self.url, limit)
        try:
            self.pool.open(sessions)
        except ServerError as error:
            self.pool.close()
            most = error.data.get("max_sessions")
            limit_text = f"at most {most} session{'s' if most != 1 else ''} at once" if most else "no more sessions"
            raise TaskError(
                f"the OpenEnv server at {self.url} accepts {limit_text} ({error}), and this rank runs "
                f"{sessions} episodes at once ({self.options.explain_episodes(len(self.test))}), "
                f"{sessions} x {self.options.generating_ranks} = {sessions * self.options.generating_ranks} over the "
                "run's ranks: start the server with max_concurrent_envs at least that (its environment class must "
                "set SUPPORTS_CONCURRENT_SESSIONS = True), or lower --prompts-per-step, --num-generations or "
                "--num-eval-prompts") from error
        except OSError as error:
            self.pool.close()
            raise TaskError(f"cannot open a session on the OpenEnv server at {self.url} ({error})") from error
        atexit.register(self.pool.close)  # before a launched server stops (exit handlers run last first): no
        # session left open for its graceful shutdown to wait on
        self.tools, self.tool_schemas = {}, []
        if self.tools_mode:
            session = self.pool.take()
            listed = session.request("step", {"type": "list_tools"}).get("observation", {}).get("tools", [])
            self.pool.give_back(session)
            self.tool_schemas = [{"type": "function", "function": {
                "name": t["name"], "description": t.get("description", ""),
                "parameters": t.get("input_schema") or t.get("inputSchema") or {"type": "object", "properties": {}}}}
                for t in listed]
            self.tools = {t["function"]["name"]: t for t in self.tool_schemas}

    def environment(self) -> "OpenEnvEnvironment":
        return OpenEnvEnvironment(self)

    def parse_call(self, text: str) -> object:
        """A tool environment's call in the turn (None: an answer; a string: why it is malformed)."""
        return hermes_call(text)

    def format_prompt(self, tokenizer: object, example: Example) -> str:
        if self.tool_schemas and self.chat_template and getattr(tokenizer, "chat_template", None):
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            return tokenizer.apply_chat_template([*system, {"role": "user", "content": example.prompt}],
                                                 tokenize=False, add_generation_prompt=True, tools=self.tool_schemas)
        return super().format_prompt(tokenizer, example)

    def environment_record(self) -> dict[str, object]:
        from importlib.metadata import version

        return {"contract": "OpenEnv", "url": self.url, "launched": self.launched,
                "server": {k: self.metadata.get(k) for k in ("name", "version", "author", "documentation_url")},
                "openenv_core": version("openenv-core"), "tools": sorted(self.tools) if self.tools_mode else None,
                "action_field": self.action_field, "observation_field": self.observation_field, "rows": self.rows,
                "sessions_per_rank": self.options.episodes_at_once(len(self.test))}


class OpenEnvEnvironment(Environment):
    """One episode on one session of the task's pool (the module docstring)."""
    probe_text = None  # the server decides what a valid action is: the probe resets and finishes only

    def __init__(self, task: OpenEnvTask) -> None:
        self.task = task
        self.event_names = (("tool_calls", "failed_malformed", "failed_unknown_tool") if task.tools_mode else ()) + (
            "failed_error", "failed_timeout", "failed_connection", "reconnects")
        self.session: Session | None = None

    def reset(self, example: Example) -> str | None:
        self.history: list[tuple[str, dict, dict]] = []  # what the episode sent and got, to replay on a new session
        data = {"seed": self.seed, **example.data}  # the row's own seed, if it has one, wins
        try:
            answer = self.send("reset", data)
        except (ServerError, TimeoutError, ConnectionLost) as error:
            raise RuntimeError(f"the OpenEnv server at {self.task.url} failed the reset: {error!r}") from error
        opening = None if self.task.tools_mode else answer.get("observation", {}).get(self.task.observation_field)
        self.example = replace(example, prompt=example.prompt + (opening or ""))
        return opening or None

    def send(self, kind: str, data: dict) -> dict:
        """One message of the episode and its answer's data. Where the connection drops, a fresh session replays the
        episode first (Diverged when it answers otherwise; ConnectionLost after RECONNECTS fresh sessions)."""
        from websockets.exceptions import ConnectionClosed

        drops = 0
        while True:
            try:
                if self.session is None:
                    self.session = self.task.pool.take()
                    for sent_kind, sent, received in self.history:  # the episode so far, again
                        if self.session.request(sent_kind, sent) != received:
                            raise Diverged(f"the replayed {sent_kind} answered otherwise on a new session of "
                                           f"{self.task.url} (an unseeded or non-deterministic environment)")
                    if self.history:
                        self.events["reconnects"] += 1
                answer = self.session.request(kind, data)
            except (TimeoutError, Diverged):  # a late answer may still come: the connection is out of step
                self.drop()
                raise
            except (ConnectionClosed, OSError) as error:  # dropped: a fresh session, the episode replayed
                self.drop()
                drops += 1
                if drops > RECONNECTS:
                    raise ConnectionLost(f"the connection to {self.task.url} dropped {drops} times in one call: "
                                         f"{error!r}") from error
                continue
            self.history.append((kind, data, answer))
            return answer

    def drop(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def step(self, text: str) -> tuple[str | None, float, bool]:
        if self.task.tools_mode:
            call = self.task.parse_call(text)
            if call is None:
                return None, self.task.finite_reward(self.task.reward(text, self.example), "the task's reward"), True
            if isinstance(call, str):
                self.events["failed_malformed"] += 1
                return f"error: {call}", 0.0, False
            self.events["tool_calls"] += 1
            if call.name not in self.task.tools:
                self.events["failed_unknown_tool"] += 1
                return f"error: no tool {call.name!r}; the tools are {', '.join(self.task.tools)}", 0.0, False
            action = {"type": "call_tool", "tool_name": call.name, "arguments": call.arguments}
        else:
            action = {self.task.action_field: text}
        try:
            answer = self.send("step", action)
        except ServerError:  # the server refused the action or the environment raised: the episode ends
            self.events["failed_error"] += 1
            return None, 0.0, True
        except TimeoutError:
            self.events["failed_timeout"] += 1
            warn_once(f"OpenEnv: a step at {self.task.url} ran past its {self.task.options.time_limit_s:g} s limit "
                      "(--env-time-limit-s): its episode ends (counted as episode/failed_timeout); warned once")
            return None, 0.0, True
        except (Diverged, ConnectionLost):
            self.events["failed_connection"] += 1
            return None, 0.0, True
        observation, done = answer.get("observation", {}), bool(answer.get("done", False))
        reward = self.task.finite_reward(answer.get("reward") or 0.0, f"the OpenEnv server's step at {self.task.url}")
        if self.task.tools_mode:
            if observation.get("error"):
                self.events["failed_error"] += 1
                reply = f"error: {observation['error'].get('message', observation['error'])}"
            else:
                reply = result_text(observation.get("result"))
            reply = reply if len(reply) <= MAX_REPLY_CHARS else reply[:MAX_REPLY_CHARS] + "\n[output cut]"
        else:
            reply = observation.get(self.task.observation_field)
            if not done and not isinstance(reply, str):
                raise TypeError(f"the OpenEnv server at {self.task.url} answered a step with the observation field "
                                f"{self.task.observation_field!r} = {reply!r:.60}, not text")
        return (None if done else reply), reward, done

    def finish(self) -> float:
        """The session back to the pool (a dropped one is gone already)."""
        if self.session is not None:
            self.task.pool.give_back(self.session)
            self.session = None
        return 0.0
