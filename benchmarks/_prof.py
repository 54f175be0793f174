import asyncio, subprocess, sys, tempfile
from pathlib import Path
from benchmarks import bench_vs_smg as b
async def main():
    tmp = Path(tempfile.mkdtemp())
    lb, agents, replicas = await b.start_mesh(tmp, 200)
    try:
        await b.grpc_load(lb.address, replicas, 200, 32, 16, "warm")
        target = {"lb": lb.pid, "agent": agents[0].pid}[sys.argv[1]]
        spy = subprocess.Popen(["/root/.cache/rollmesh/tools/bin/py-spy", "record", "--pid", str(target), "--format", "raw",
                                "--rate", "250", "--nonblocking", "-o", f"/tmp/prof-{sys.argv[1]}-{sys.argv[2]}.txt", "--duration", "8"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if sys.argv[2] == "short":
            await b.grpc_load(lb.address, replicas, 3000, 128, 16, "s")
        else:
            await b.grpc_load(lb.address, replicas, 600, 256, 256, "s", final_only=(sys.argv[2] == "final"))
        spy.wait()
    finally:
        await asyncio.gather(*(p.terminate() for p in (lb, *agents)))
asyncio.run(main())
