"""``python -m services.adapter_store [--flags]``: run the adapter store until SIGTERM."""

from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.service import AdapterStoreService
from services.runtime.rpc.server import run_service

if __name__ == "__main__":
    run_service(AdapterStoreConfig, AdapterStoreService, "adapter_store")
