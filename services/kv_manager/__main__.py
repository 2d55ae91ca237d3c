"""``python -m services.kv_manager [--flags]``: run the kv_manager until SIGTERM."""

from services.kv_manager.config import KVManagerConfig
from services.kv_manager.service import KVManagerService
from services.runtime.rpc.server import run_service

if __name__ == "__main__":
    run_service(KVManagerConfig, KVManagerService, "kv_manager")
