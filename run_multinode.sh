#!/usr/bin/env bash
# Train on several nodes: run this once on every node with the same MASTER_ADDR (node 0's address).
#
# Style 1, torchrun (default): one process per local GPU, started by torchrun.
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./run_multinode.sh /data/imagenet -b 64
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./run_multinode.sh /data/imagenet -b 64
#   (-b is per process here, as with torchrun.)
# Style 2, the classic shared --dist-url: main.py spawns one process per local GPU.
#   node 0:  STYLE=dist-url NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./run_multinode.sh DIR -b 256
#   node 1:  STYLE=dist-url NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./run_multinode.sh DIR -b 256
#   (-b is per node here, as in the classic script.)
# Environment: NNODES (2), NODE_RANK (0), MASTER_ADDR (required), MASTER_PORT (29500),
# NPROC_PER_NODE (visible GPUs, or 1 on CPU), STYLE (torchrun | dist-url), PYTHON,
# MAX_RESTARTS (torchrun style: restarts of the worker group after a failure, default 0; restarted
# workers resume from OUTPUT_DIR/checkpoint.pth.tar - add --save-every N to lose little).
# If the nodes have several network interfaces, export GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME;
# otherwise main.py picks the interface that routes to MASTER_ADDR.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-$here/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0 (the same on every node)}"
NNODES=${NNODES:-2}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE=$("$PYTHON" -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
case "${STYLE:-torchrun}" in
    torchrun)
        exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
            --nproc-per-node "$NPROC_PER_NODE" --max-restarts "${MAX_RESTARTS:-0}" \
            --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$here/main.py" "$@" ;;
    dist-url)
        exec "$PYTHON" "$here/main.py" --multiprocessing-distributed \
            --nproc-per-node "$NPROC_PER_NODE" --world-size "$NNODES" --rank "$NODE_RANK" \
            --dist-url "tcp://$MASTER_ADDR:$MASTER_PORT" "$@" ;;
    *) echo "STYLE must be torchrun or dist-url" >&2; exit 2 ;;
esac
