"""``python -m services.scheduler [--flags]``: run the scheduler until SIGTERM."""

from services.runtime.rpc.server import run_service
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService

if __name__ == "__main__":
    run_service(SchedulerConfig, SchedulerService, "scheduler")
