"""The main job behind ``rollmesh train``: the whole mesh as local processes, one training run.

Order of events:

1. an in-process OTLP receiver (``spans.jsonl``) that every child exports to;
2. the load balancer, then the controller (it is told where the trainer agent
   will listen: a free port picked now), then - in parallel - one replica agent
   per rollout node (standalone replicas), the trainer node's replica agent
   (hybrid replicas, started asleep) and the trainer agent, whose rank-0
   driver waits until every replica registered, then trains;
3. while it trains: the controller's WatchEvents stream is written to
   ``events.jsonl`` and each transition printed as it happens; the trainer's
   GetTrainingProgress drives the progress bar; a replica agent that exits
   is reported (the mesh carries on), any other server that exits fails the run;
4. at the end: the metrics of every sync cycle, the scheduler state and the
   summary go to ``metrics.json``, the servers are stopped (SIGTERM, then
   SIGKILL after a grace period), the spans are flushed and the resource-time
   picture is rendered to ``resource_time.png``.

Cancelling :func:`run_job` (Ctrl-C) stops every child the same way.

Resuming (``rollmesh train --resume RUN_DIR``, ``resume`` given): the same
mesh starts afresh in the same run directory; the trainer agent resumes from
``<run_dir>/checkpoint`` (``driver.resume``) and brings every replica to the
checkpoint's weight version before it generates. Files are appended, never
rewritten: ``events.jsonl`` gets the new controller's events, each marked
``"resumed_at_step": k`` (their ``sequence`` starts at 1 again),
``trainer/steps.jsonl`` and ``spans.jsonl`` their new lines, the logs their
new output. ``metrics.json`` and ``resource_time.png`` of an earlier part
that finished are kept as ``metrics.until-step-K.json`` and
``resource_time.until-step-K.png``; the new ones cover the whole run for
steps, rewards and sample counts, and the resumed part for transitions,
cycles and the picture (see :mod:`launcher.train_report`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import grpc

from mesh_runtime import tracing
from mesh_runtime.channels import open_channel, read_methods
from mesh_runtime.config import TlsConfig
from mesh_runtime.durations import to_seconds
from mesh_runtime.net import free_port
import yaml
from google.protobuf import json_format

from .job_config import JobConfig, describe_job, server_configs
from .processes import LaunchError, ServerProcess, start_server
from .pki import LocalPki
from .span_sink import start_span_sink
from .train_report import describe_event, effective_steps, format_summary, progress_bar, summarize

FATAL = ("lb", "controller", "trainer-agent")


class Console:
    """Transition lines and a progress bar that redraws in place on a terminal."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self._bar = ""

    def line(self, text: str) -> None:
        if self.tty and self._bar:
            self.out.write("\r\033[K")
        self.out.write(text + "\n")
        if self.tty and self._bar:
            self.out.write(self._bar)
        self.out.flush()

    def bar(self, text: str, *, step_done: bool) -> None:
        if self.tty:
            self._bar = text
            self.out.write("\r\033[K" + text)
            self.out.flush()
        elif step_done:
            self.line(text)

    def end_bar(self) -> None:
        if self.tty and self._bar:
            self.out.write("\n")
            self.out.flush()
        self._bar = ""


class TrainJob:
    """One run of the main job; see the module docstring."""

    def __init__(self, job: JobConfig, run_dir: Path, env: dict[str, str], out: TextIO = sys.stdout,
                 resume: Any = None) -> None:
        """``resume``: the :class:`~trainer_agent.driver.checkpoint.CheckpointInfo` being resumed, or None."""
        self.job = job
        self.resume = resume
        self.run_dir = run_dir.resolve()   # the configs it writes name their files absolutely
        self.env = env
        self.console = Console(out)
        self.processes: dict[str, ServerProcess] = {}
        self.metrics_targets: dict[str, tuple[str, str]] = {}   # process -> (server, HOST:PORT of /metrics)
        self.events: list[dict[str, Any]] = []
        self._t0 = time.time()
        self._event_seen = asyncio.Event()
        self._trainer_channel: grpc.aio.Channel | None = None
        self.ending = False   # past training: stopping the processes, which nothing may interrupt

    # -- processes --------------------------------------------------------------------------------

    def _child_env(self, otlp_endpoint: str) -> dict[str, str]:
        env = dict(self.env)
        env.setdefault("GLOO_SOCKET_IFNAME", self.job.mesh.gloo_interface)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, str(self.job.mesh.torch_threads))
        env["PYTHONUNBUFFERED"] = "1"
        env[tracing.SINK_VARIABLE] = otlp_endpoint   # the run's own sink, beside any OTEL_* endpoint of the user
        env.setdefault("OTEL_BSP_SCHEDULE_DELAY", "1000")
        return env

    def host_of(self, name: str) -> str:
        """The address process ``name`` (or ``launcher``: this process) serves on; a local mesh: loopback."""
        return "127.0.0.1"

    def prefix_of(self, name: str) -> list[str]:
        """The command process ``name`` runs under (a local mesh: none)."""
        return []

    async def _start(self, name: str, server: str, config: dict[str, Any] | None, env: dict[str, str]) -> None:
        host = self.host_of(name)
        args = ["--listen", f"{host}:0"]
        if config is not None and self.job.mesh.metrics:
            config = {**config, "metrics_listen": f"{host}:0"}
        if config is not None:
            path = self.run_dir / "config" / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            args = ["--config", str(path)]
        self.processes[name] = await start_server(server, args, env=env, log_path=self.run_dir / "logs" / f"{name}.log",
                                                  ready_timeout_s=self.job.mesh.start_timeout_s,
                                                  prefix=self.prefix_of(name))
        self.console.line(f"  started {name:<20} {self.processes[name].address:<22} pid {self.processes[name].pid}")
        if self.job.mesh.metrics:
            found = re.search(r"Prometheus metrics on http://(\S+)/metrics",
                              (self.run_dir / "logs" / f"{name}.log").read_text())
            if found:
                self.metrics_targets[name] = (server, found.group(1))

    def _write_metrics_targets(self) -> None:
        """``prometheus_targets.json``: every process's /metrics, as Prometheus file_sd_configs read it."""
        targets = [{"targets": [address], "labels": {"job": "rollmesh", "server": server, "process": name}}
                   for name, (server, address) in sorted(self.metrics_targets.items())]
        path = self.run_dir / "prometheus_targets.json"
        partial = path.with_suffix(".json.tmp")
        partial.write_text(json.dumps(targets, indent=2))
        partial.replace(path)   # Prometheus re-reads the file as it changes: never let it see half of it
        self.console.line(f"metrics: {len(targets)} /metrics endpoints, listed in {path} (file_sd)")

    def _tls(self, role: str, name: str, host: str = "127.0.0.1") -> dict[str, str] | None:
        """The ``tls`` section of ``spiffe://rollmesh/<role>/<name>`` serving on ``host`` (made in ``pki/``),
        or None without TLS."""
        if not self.job.mesh.tls:
            return None
        return LocalPki(self.run_dir / "pki", ca_name="rollmesh train CA").section(role, name, hosts=[host])

    def _client_tls(self) -> TlsConfig | None:
        """The launcher's own identity (an operator) for its channels into the mesh."""
        section = self._tls("operator", "rollmesh-train")
        return TlsConfig(**section) if section is not None else None

    def _with_tls(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        if name in ("controller", "lb"):
            role, identity = name, name
        elif name == "trainer-agent":
            role, identity = "trainer-agent", config["node_id"]
        else:
            role, identity = "replica-agent", config["node_id"]
        host = self.host_of(name)
        section = self._tls(role, identity, host)
        placed = {**config, "listen": config["listen"].replace("127.0.0.1:", f"{host}:", 1)}
        if name == "trainer-agent":
            placed["weight_rendezvous"] = f"{host}:0"   # where the replicas reach its weight broadcasts
        return {**placed, "tls": section} if section is not None else placed

    async def _start_mesh(self, env: dict[str, str]) -> dict[str, dict]:
        await self._start("lb", "lb", self._with_tls("lb", {"listen": "127.0.0.1:0"}), env)
        host = self.host_of("trainer-agent")
        trainer_address = f"{host}:{free_port() if host == '127.0.0.1' else 50054}"
        lb = self.processes["lb"].address
        configs = server_configs(self.job, run_dir=self.run_dir, lb=lb, controller="", trainer=trainer_address)
        await self._start("controller", "controller", self._with_tls("controller", configs["controller"]), env)
        configs = server_configs(self.job, run_dir=self.run_dir, lb=lb, controller=self.processes["controller"].address,
                                 trainer=trainer_address)
        configs = {n: self._with_tls(n, c) for n, c in configs.items()}
        rest = [n for n in configs if n not in ("controller",)]
        await asyncio.gather(*(self._start(n, "trainer-agent" if n == "trainer-agent" else "replica-agent",
                                           configs[n], env) for n in rest))
        if self.job.mesh.metrics:
            self._write_metrics_targets()
        (self.run_dir / "processes.json").write_text(json.dumps(
            {n: {"pid": p.pid, "address": p.address, "server": p.name, "log": str(p.log_path)}
             for n, p in self.processes.items()}, indent=2))
        return configs

    async def _stop_all(self) -> dict[str, int]:
        order = ["trainer-agent", *[n for n in self.processes if n not in FATAL], "controller", "lb"]
        codes = {}
        for group in (order[:1], order[1:-2], order[-2:]):
            present = [n for n in group if n in self.processes]
            results = await asyncio.gather(*(self.processes[n].terminate() for n in present))
            codes.update(dict(zip(present, results)))
        return codes

    # -- watching ---------------------------------------------------------------------------------

    async def _watch_events(self, channel: grpc.aio.Channel) -> None:
        from rollmesh.controller.v1 import controller_pb2_grpc, observability_pb2  # noqa: PLC0415

        from .resource_picture import event_dict_from_proto as convert  # noqa: PLC0415

        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        with (self.run_dir / "events.jsonl").open("a" if self.resume is not None else "w") as out:
            async for reply in stub.WatchEvents(observability_pb2.WatchEventsRequest(include_history=True)):
                event = convert(reply.event)
                if self.resume is not None:
                    event["resumed_at_step"] = self.resume.global_step
                self.events.append(event)
                out.write(json.dumps(event) + "\n")
                out.flush()
                self.console.line(describe_event(event, self._t0))
                self._event_seen.set()

    async def _wait_for_events(self, channel: grpc.aio.Channel, timeout_s: float = 15.0) -> None:
        """Until the stream delivered the controller's newest event (so events.jsonl is complete)."""
        from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc  # noqa: PLC0415

        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        last = (await stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=10)).last_event_sequence
        deadline = time.monotonic() + timeout_s
        while (not self.events or self.events[-1]["sequence"] < last) and time.monotonic() < deadline:
            self._event_seen.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event_seen.wait(), 0.5)

    async def _follow_training(self, trainer: grpc.aio.Channel) -> dict[str, Any]:
        from rollmesh.trainer.v1 import trainer_agent_pb2, trainer_agent_pb2_grpc  # noqa: PLC0415

        stub = trainer_agent_pb2_grpc.TrainerAgentServiceStub(trainer)
        shown_step, reported_exits = -1, set()
        while True:
            reply = await stub.GetTrainingProgress(trainer_agent_pb2.GetTrainingProgressRequest(), timeout=10)
            progress = json_format.MessageToDict(reply, preserving_proto_field_name=True,
                                                 always_print_fields_with_no_presence=True)
            state = trainer_agent_pb2.TrainingState.Name(reply.state).removeprefix("TRAINING_STATE_")
            progress["state"] = state
            reward = reply.last_reward_mean if reply.HasField("last_reward_mean") else None
            total = reply.final_step or self.job.trainer.total_training_steps   # earlier after StopTraining
            self.console.bar(progress_bar(reply.global_step, total, reward=reward, queue=reply.queue_size,
                                          state=state), step_done=reply.global_step != shown_step)
            shown_step = reply.global_step
            if state in ("FINISHED", "FAILED"):
                self.console.end_bar()
                return progress
            for name, proc in self.processes.items():
                code = proc.process.returncode
                if code is not None and name not in reported_exits:
                    reported_exits.add(name)
                    if name in FATAL:
                        raise RuntimeError(f"{name} exited with code {code}; see {proc.log_path}")
                    self.console.line(f"  {name} exited with code {code}; training continues on the other replicas")
            await asyncio.sleep(0.3)

    async def _collect_metrics(self, channel: grpc.aio.Channel) -> tuple[list[dict], dict]:
        from rollmesh.controller.v1 import (  # noqa: PLC0415
            controller_pb2_grpc,
            observability_pb2,
            scheduling_pb2,
        )

        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        cycles = []
        reply = await stub.GetMetrics(observability_pb2.GetMetricsRequest(from_cycle=1, limit=100_000), timeout=10)
        for c in reply.cycles:
            cycles.append({"cycle": c.cycle, "global_step": c.global_step, "weight_version": c.weight_version,
                           "started_at": to_seconds(c.started_at),
                           "ended_at": to_seconds(c.ended_at) if c.HasField("ended_at") else None,
                           "values": dict(c.values)})
        state = await stub.GetSchedulerState(scheduling_pb2.GetSchedulerStateRequest(), timeout=10)
        return cycles, json_format.MessageToDict(state, preserving_proto_field_name=True)

    # -- the run ----------------------------------------------------------------------------------

    async def run(self) -> int:
        for sub in ("config", "logs", "trainer"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        self.console.line(f"rollmesh train: {describe_job(self.job)}")
        self.console.line(f"run directory: {self.run_dir}")
        if self.resume is not None:
            r = self.resume
            for name, suffix in (("metrics", ".json"), ("resource_time", ".png")):
                earlier = self.run_dir / f"{name}{suffix}"
                if earlier.exists():
                    earlier.replace(self.run_dir / f"{name}.until-step-{r.global_step}{suffix}")
            self.console.line(f"resuming after step {r.global_step} (weight version {r.weight_version}; "
                              f"{r.queue_size} samples queued, {r.pending_groups} groups unfinished; generated "
                              f"{r.generated}, consumed {r.consumed}, dropped {r.dropped})")
        sink_server, sink, endpoint = await start_span_sink(self.run_dir / "spans.jsonl", self.host_of("launcher"))
        watcher: asyncio.Task | None = None
        channels: list[grpc.aio.Channel] = []
        outcome: dict[str, Any] = {}
        try:
            try:
                await self._start_mesh(self._child_env(endpoint))
            except LaunchError as err:
                self.console.line(f"rollmesh train: error: {err}")
                return 1
            tls = self._client_tls()
            ctl = open_channel(self.processes["controller"].address, tls=tls, idempotent=read_methods())
            trainer = open_channel(self.processes["trainer-agent"].address, tls=tls, idempotent=read_methods())
            channels += [ctl, trainer]
            self._trainer_channel = trainer
            watcher = asyncio.create_task(self._watch_events(ctl), name="watch-events")
            try:
                progress = await self._follow_training(trainer)
            except (RuntimeError, grpc.aio.AioRpcError) as err:
                self.console.end_bar()
                detail = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.aio.AioRpcError) else err
                self.console.line(f"rollmesh train: error: {detail}")
                return 1
            await self._wait_for_events(ctl)
            cycles, scheduler = await self._collect_metrics(ctl)
            outcome = {"progress": progress, "cycles": cycles, "scheduler": scheduler}
        finally:
            self.ending = True
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            for channel in channels:
                await channel.close()
            codes = await self._stop_all()
            await sink_server.stop(grace=2)
            if codes:
                self.console.line("stopped: " + ", ".join(f"{n} (exit {c})" for n, c in codes.items()))
        return self._finish(outcome)

    async def stop_training(self) -> int:
        """End the run after the step the trainer is in (its StopTraining); returns that step. Raises
        LookupError before the trainer is up, grpc.aio.AioRpcError when the trainer refuses."""
        from rollmesh.trainer.v1 import trainer_agent_pb2, trainer_agent_pb2_grpc  # noqa: PLC0415

        if self._trainer_channel is None:
            raise LookupError("the trainer agent is not started yet")
        stub = trainer_agent_pb2_grpc.TrainerAgentServiceStub(self._trainer_channel)
        reply = await stub.StopTraining(trainer_agent_pb2.StopTrainingRequest(), timeout=10)
        return reply.final_step

    def _finish(self, outcome: dict[str, Any]) -> int:
        progress = outcome["progress"]
        steps = [json.loads(line) for line in (self.run_dir / "trainer" / "steps.jsonl").read_text().splitlines()
                 if line.strip()]
        step_lines = effective_steps(steps)
        resumed_at = self.resume.global_step if self.resume is not None else None
        summary = summarize(events=self.events, steps=step_lines, cycles=outcome["cycles"], progress=progress,
                            wall_s=time.time() - self._t0, total_steps=self.job.trainer.total_training_steps,
                            resumed_at_step=resumed_at)
        picture = self.run_dir / "resource_time.png"
        try:
            from .resource_picture import render_resource_picture  # noqa: PLC0415

            shown = [s for s in step_lines if resumed_at is None or s["global_step"] > resumed_at]
            trainer_row = [{"row": "trainer", **a} for s in shown for a in s.get("activities", [])]
            title = f"rollmesh train: {self.run_dir.name}" + (
                "" if resumed_at is None else f" (since resume at step {resumed_at})")
            render_resource_picture(self.events, str(picture), title=title, activities=trainer_row)
            summary["picture"] = str(picture)
            from .reward_picture import render_reward_picture  # noqa: PLC0415

            render_reward_picture(step_lines, str(self.run_dir / "reward.png"), title=f"reward: {self.run_dir.name}")
        except ImportError as err:
            summary["picture"] = f"not rendered: {err}"
        (self.run_dir / "metrics.json").write_text(json.dumps(
            {"summary": summary, "cycles": outcome["cycles"], "scheduler": outcome["scheduler"],
             "progress": progress, "steps": step_lines}, indent=2))
        self.console.line(format_summary(summary))
        self.console.line(f"events: {self.run_dir / 'events.jsonl'}  metrics: {self.run_dir / 'metrics.json'}  "
                          f"spans: {self.run_dir / 'spans.jsonl'}  picture: {summary['picture']}  "
                          f"reward: {self.run_dir / 'reward.png'}")
        if progress["state"] != "FINISHED":
            self.console.line(f"rollmesh train: error: training {progress['state'].lower()}: "
                              f"{progress.get('error_message', '')}")
            return 1
        return 0
