from specmesh.runtime.threads import set_thread_wait

set_thread_wait(spin=True)  # before torch and llama.cpp load libgomp (specmesh/runtime/threads.py)

from verifier_service.server import run  # noqa: E402

run()
