"""``python -m services.gateway [--flags]``: run the gateway until SIGTERM."""

from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from services.runtime.rpc.server import run_service

if __name__ == "__main__":
    run_service(GatewayConfig, GatewayService, "gateway")
