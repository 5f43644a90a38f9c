"""How one episode of a verifiers environment plays in process (``rllight.envs.verifiers_env``).

The environment's coroutines (``Env.run`` and the task's hooks) run on one event loop per process, on its own
thread, as verifiers runs concurrent rollouts on one loop. An episode is a ``Play``: the threads that step it hand
it the policy's turns and wait for what the environment answers; the loop side stands in for verifiers' agents
(``Seats``, ``Seat``) and their exchanges (``Exchange``, verifiers' ``Interaction``): each model turn of an exchange
waits for the policy's text instead of calling a model endpoint, is committed to the exchange's ``vf.Trace`` as
verifiers commits an intercepted turn, and the trace is scored by the task's own rewards when the exchange closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import threading
import time
import uuid

_SLICE = 0.05  # seconds: a wait for the loop is made of slices, so an exception raised in the waiting thread lands

_LOOP: tuple[int, asyncio.AbstractEventLoop] | None = None
_LOOP_LOCK = threading.Lock()


def shared_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop for verifiers' coroutines, on a daemon thread started on first use (again in a
    forked child). The threads that step episodes only hand it text and wait for its answer."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="rllight-verifiers", daemon=True).start()
            _LOOP = (os.getpid(), loop)
        return _LOOP[1]


STOP = object()
"""Handed to an episode waiting for a model turn when rllight ended the episode (its turn or token limit)."""


def observation(messages: list) -> str | list[dict] | None:
    """What the model is shown of the messages an environment sent since its last turn: None for none, the text of
    a single user message, else chat messages (tool results keep their ``tool_call_id`` and ``name``)."""
    from verifiers.v1.types import content_text

    if not messages:
        return None
    if len(messages) == 1 and messages[0].role == "user":
        return content_text(messages[0].content)
    out = []
    for message in messages:
        entry = {"role": message.role, "content": content_text(message.content)}
        if message.role == "tool":
            entry["tool_call_id"] = message.tool_call_id
            if message.name:
                entry["name"] = message.name
        out.append(entry)
    return out


class Play:
    """One episode of a verifiers environment (``source``, a ``verifiers_env.Source``) on ``task``.

    The caller's side (``start``, ``send``, ``wait``, ``cancel``) runs on the threads that step the episode, the
    rest on the shared loop. Events from the loop: ``("ask", observation)`` at each model turn, ``("end", None)``
    when the environment is done (``reward`` is then the trace's), ``("error", exception)`` when it failed."""

    def __init__(self, source, task):
        self.source, self.task = source, task
        self.events: queue.Queue = queue.Queue()
        self.reply: asyncio.Future | None = None
        self.future = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.exchange: Exchange | None = None
        self.reward: float | None = None
        self.stop_reason = "max_turns"
        """The trace's stop condition when rllight ends the episode (set by the caller before ``send(STOP)``)."""

    @property
    def tools(self) -> list[dict] | None:
        """The tools offered to the model (JSON schemas), known from its first turn on; None = none."""
        return (self.exchange.tools.schemas or None) if self.exchange is not None else None

    # ------------------------------------------------------------------------------------ caller side
    def start(self) -> None:
        self.loop = shared_loop()
        self.future = asyncio.run_coroutine_threadsafe(self._main(), self.loop)

    def send(self, reply) -> None:
        """Answer the model turn the episode waits for with ``(text, calls)`` (calls: ``(verifiers ToolCall, error or
        None)`` pairs), or ``STOP``."""
        self.loop.call_soon_threadsafe(self._deliver, reply)

    def _deliver(self, reply) -> None:
        if self.reply is not None and not self.reply.done():
            self.reply.set_result(reply)

    def wait(self) -> tuple[str, object]:
        """The next event. The guard's limit bounds the wait; anything raised in this thread meanwhile (the guard
        giving up, Ctrl-C) cancels the episode's coroutine."""
        try:
            while True:
                try:
                    return self.events.get(timeout=_SLICE)
                except queue.Empty:
                    if self.future.done() and self.events.empty():
                        return "error", RuntimeError("the episode's coroutine ended without an answer")
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        """Cancel the episode's coroutine (no-op once it is done): its exchange closes without scoring."""
        if self.future is not None and not self.future.done():
            self.future.cancel()

    # -------------------------------------------------------------------------------------- loop side
    async def _main(self) -> None:
        try:
            await self._episode()
        except Exception as err:  # noqa: BLE001 - the environment's fault: the episode fails, the run goes on
            self.events.put(("error", err))
            return
        self.events.put(("end", None))

    async def _episode(self) -> None:
        vf, env, seats = self.source.vf, self.source.env, Seats(self)
        if env is None:  # a plain taskset: verifiers' SingleAgentEnv
            await seats.agent.run(self.task)
            self.reward = float(self.exchange.trace.reward)
            return
        await env.setup(seats)
        await env.run(self.task, seats)
        if self.exchange is None:
            raise RuntimeError(f"{type(env).__name__}.run() ran no exchange with the policy")
        from verifiers.v1.trace import TraceTask

        trace, task = self.exchange.trace, self.task
        episode = vf.Episode(env=vf.EnvInfo(id=env.config.env_id), traces=[trace], ok=trace.ok,
                             task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash))
        await env.finalize(task, episode)
        self.reward = float(trace.reward)

    async def ask(self, messages: list):
        """Wait for the policy's next turn after ``messages`` (what the environment sent since its last turn)."""
        self.reply = asyncio.get_running_loop().create_future()
        self.events.put(("ask", observation(messages)))
        return await self.reply

    async def open(self, seat: Seat, task) -> Exchange:
        """Open the policy's exchange on ``task`` through ``seat``: one per episode, as rllight plays one
        conversation per episode."""
        if not seat.trainable:
            raise RuntimeError(f"the seat {seat.name!r} is not the policy (trainable=False); rllight has no other "
                               "model to play it")
        if self.exchange is not None:
            raise RuntimeError("the environment opened a second exchange with the policy in one episode; rllight plays "
                               "one conversation per episode")
        self.exchange = Exchange(self, seat, task)
        try:
            await self.exchange.open()
        except BaseException:
            await self.exchange.close(failed=True)
            raise
        return self.exchange


class Seat:
    """One seat of the environment (``agents.<name>``), played by the policy: verifiers' ``Agent`` for ``run`` (one
    segment on the task's prompt) and ``interaction`` (an exchange the environment drives turn by turn). Borrowed
    runtimes and tools passed as keywords are ignored (nothing runs in a runtime here)."""

    def __init__(self, play: Play, name: str, config):
        self.play, self.name, self.config = play, name, config
        self.trainable = True

    @contextlib.asynccontextmanager
    async def interaction(self, task, **_borrowed):
        exchange = await self.play.open(self, task)
        failed = True
        try:
            yield exchange
            failed = False
        finally:
            await exchange.close(failed)

    async def run(self, task, **_borrowed):
        async with self.interaction(task) as exchange:
            if task.data.prompt is None:
                raise ValueError("the task has no prompt and no user to open the conversation")
            exchange.completion = "agent_completed"
            await exchange.turn()
        return exchange.trace


class Seats:
    """The environment's ``agents``: every seat it declares (``agents.<name>``), each played by the policy."""

    def __init__(self, play: Play):
        self._seats = {name: Seat(play, name, config) for name, config in play.source.seats.items()}

    def __getattr__(self, name: str) -> Seat:
        seats = self.__dict__.get("_seats")
        if seats is None or name not in seats:
            raise AttributeError(f"no agent {name!r}; this environment declares {sorted(seats or [])}")
        return seats[name]


class Exchange:
    """The policy's exchange on one task (verifiers' ``Interaction``), with its ``trace``.

    ``turn(message)`` sends the environment's message (text, or chat messages) and returns the segment that
    answers it (``vf.Segment``): the policy's reply, and with tools, every call, its result and the reply after
    it. Before each model turn the seat's ``max_turns`` and the task's ``@vf.stop`` hooks (on the trace and on the
    request) may end the exchange; a ``@vf.stop`` on the response ends it without committing the turn. A prompted
    task is opened by a bare ``turn()``, a prompt-less one by ``turn(message)``, as in verifiers."""

    def __init__(self, play: Play, seat: Seat, task):
        from verifiers.v1.session import RolloutLimits, hook_boundary
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        self.vf, self.play, self.task = play.source.vf, play, task
        self.trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                           state=state_cls(type(task))(), agent=AgentInfo(config=seat.config, name=seat.name))
        self.limits = RolloutLimits(max_turns=seat.config.max_turns)
        self.stops: dict[str, list] = {"Trace": [], "Request": [], "Response": []}
        for fn in task.hooks("stop"):
            self.stops[hook_boundary(fn, allow_trace=True).__name__].append(fn)
        self.tools = ToolServers()
        self.transcript = self._opening(task.data)
        self.started = self.over = self.closed = False
        self.completion = "user_closed"
        """The trace's stop condition when the exchange ends normally (``agent_completed`` for ``Seat.run``)."""

    def _opening(self, data) -> list:
        vf = self.vf
        messages = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
        if isinstance(data.prompt, str):
            messages.append(vf.UserMessage(content=data.prompt))
        elif data.prompt:
            messages += list(data.prompt)
        return messages

    async def open(self) -> None:
        from verifiers.v1.utils.decorators import invoke

        await invoke(self.task.setup, {"trace": self.trace, "runtime": None})
        await self.tools.open(self.play.source, self.task)

    async def turn(self, message=None):
        """Send one message of the environment (None: the prompted task's opening) and return the policy's
        segment; a terminated segment when the exchange ended instead (a limit, a ``@vf.stop``, rllight's limits)."""
        from verifiers.v1.dialects import parse_message

        if self.closed or self.over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        prompted = not self.started and self.task.data.prompt is not None
        if (message is None) != prompted:
            raise ValueError("a prompted task is opened by a bare turn(), and then each turn takes the next user "
                             "message" if prompted else "this exchange takes its next user message: turn(message)")
        self.started = True
        if message is None:
            new = []
        elif isinstance(message, str):
            new = [self.vf.UserMessage(content=message)]
        else:
            new = [parse_message(m) if isinstance(m, dict) else m for m in message]
        return await self._segment(new)

    async def _segment(self, pending: list):
        vf, answered = self.vf, []
        while True:
            request = vf.Request(messages=[*self.transcript, *pending], tools=self.tools.vf_tools or None)
            if await self._refused(request):
                break
            reply = await self.play.ask(pending)
            if reply is STOP:
                self.trace.stop(self.play.stop_reason)
                break
            text, calls = reply
            message = vf.AssistantMessage(content=text, tool_calls=[call for call, _ in calls] or None)
            response = vf.Response(id=uuid.uuid4().hex, created=int(time.time()), model="rllight-policy",
                                   message=message, finish_reason="tool_calls" if calls else "stop")
            if await self._stopped(self.stops["Response"], {vf.Response: response}):
                break
            from verifiers.v1 import graph

            graph.prepare_turn(self.trace, request.messages, request.tools).commit(response)
            self.transcript = [*request.messages, message]
            answered.append(message)
            if not calls:
                return vf.Segment(messages=answered)
            pending = [await self.tools.call(call, error) for call, error in calls]
            answered += pending
        if answered:  # the segment answered before the exchange ended: the next turn is the terminated one
            return vf.Segment(messages=answered)
        self.over = True
        return vf.Segment(messages=[], terminated=True)

    async def _refused(self, request) -> bool:
        if self.trace.stop_condition is not None:
            return True
        if (limit := self.limits.reached(self.trace)) is not None:
            self.trace.stop(limit)
            return True
        return (await self._stopped(self.stops["Trace"], {self.vf.Trace: self.trace})
                or await self._stopped(self.stops["Request"], {self.vf.Request: request}))

    async def _stopped(self, hooks: list, available: dict) -> bool:
        """Whether one of ``hooks`` (``@vf.stop``) fires; the first that does stops the trace."""
        from verifiers.v1.session import call_hook

        for hook in hooks:
            result = await call_hook(hook, available)
            if not isinstance(result, bool):
                raise TypeError(f"@vf.stop {hook.__name__} must return bool, got {type(result).__name__}")
            if result:
                self.trace.stop(hook.__name__)
                return True
        return False

    async def close(self, failed: bool) -> None:
        """End the exchange: unless it failed, the task's ``finalize`` and its scoring (metrics, rewards) run on the
        trace; the tool servers close either way."""
        from verifiers.v1.utils.decorators import invoke

        if self.closed:
            return
        self.closed, trace = True, self.trace
        try:
            if not failed:
                trace.stop(self.completion)  # the first stop condition stays
                await invoke(self.task.finalize, {"trace": trace, "runtime": None})
                await self.task.score(trace, None)
        finally:
            await self.tools.close()
            trace.is_completed, trace.ok = True, not failed


class ToolServers:
    """The task's tool servers (``Task.toolsets``, then the taskset's ``Taskset.toolsets``), each a ``vf.Toolset``
    served in process by ``mcp``'s ``MCPServer`` for one exchange. A tool is named as verifiers' harnesses name it
    (``<server>_<tool>``, or bare for a server without prefix). A toolset with its own ``State`` sees a fresh state
    at each call (verifiers syncs it over HTTP, which this does not serve)."""

    def __init__(self):
        self.schemas: list[dict] = []
        """The tools as JSON schemas, for the chat template."""
        self.vf_tools: list = []
        self._toolsets: list = []
        self._dispatch: dict[str, tuple] = {}

    async def open(self, source, task) -> None:
        scoped = [(toolset, True) for toolset in task.toolsets(task.config)]
        shared = [(toolset, False) for toolset in source.taskset.toolsets(source.taskset.config)]
        if not scoped and not shared:
            return
        from mcp.server.mcpserver import MCPServer

        for toolset, per_task in scoped + shared:
            self._toolsets.append(toolset)
            await toolset.setup()
            if per_task:
                await toolset.setup_task(task)
            server = MCPServer(toolset.server_name or type(toolset).__name__)
            toolset.register(server)
            for tool in await server.list_tools():
                name = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
                self._dispatch[name] = (server, tool.name)
                self.vf_tools.append(source.vf.Tool(name=name, description=tool.description or "",
                                                    parameters=tool.input_schema))
                self.schemas.append({"type": "function", "function": {
                    "name": name, "description": tool.description or "", "parameters": tool.input_schema}})

    async def call(self, call, error: str | None = None):
        """The result of one tool call (a verifiers ``ToolCall``; ``error``: why it could not be read) as a tool
        message; a call that cannot be made (unreadable, no such tool, the tool raised) gets its error as the
        result, for the model to read."""
        from verifiers.v1.types import ToolMessage

        if error is not None:
            text = f"error: {error}"
        elif call.name not in self._dispatch:
            text = f"error: no tool named {call.name!r} (tools: {', '.join(self._dispatch)})"
        else:
            server, raw = self._dispatch[call.name]
            try:
                result = await server.call_tool(raw, json.loads(call.arguments or "{}"))
                text = "\n".join(getattr(block, "text", None) or str(block) for block in result.content)
            except Exception as err:  # noqa: BLE001 - the tool's fault: the model reads it, the episode goes on
                text = f"error: {type(err).__name__}: {' '.join(str(err).split())[:300]}"
        return ToolMessage(tool_call_id=call.id, content=text, name=call.name or None)

    async def close(self) -> None:
        for toolset in self._toolsets:
            with contextlib.suppress(Exception):
                await toolset._exit_stack.aclose()
