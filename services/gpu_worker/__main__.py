"""``python -m services.gpu_worker [--flags]``: run a worker until SIGTERM."""

from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.service import WorkerService
from services.runtime.rpc.server import run_service

if __name__ == "__main__":
    run_service(WorkerConfig, WorkerService, "gpu_worker")
