from verifier_service.server import run

run()
