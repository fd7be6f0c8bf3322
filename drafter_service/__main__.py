from specmesh.runtime.threads import set_thread_wait

set_thread_wait(spin=False)  # before torch and llama.cpp load libgomp (specmesh/runtime/threads.py)

from drafter_service.server import run  # noqa: E402

run()
