# GPU image for clusters. The NGC PyTorch base brings CUDA, NCCL, torch, apex and
# Transformer Engine (both are used when importable on CUDA, never required).
# Build:  docker build -t megatron-sysx .
# Run:    docker run --gpus all --ipc=host --shm-size=64g megatron-sysx \
#             torchrun --nproc-per-node 4 pretrain_llama.py --model-preset 10b
# The parameter store lives in /dev/shm: Docker's default of 64 MB is far too small, so
# give it --ipc=host or a --shm-size of at least the model's 16-bit parameters (2 B/param).
FROM nvcr.io/nvidia/pytorch:25.01-py3

WORKDIR /workspace/megatron-sysx
COPY requirements.txt setup.py pyproject.toml ./
# megatron-core without its dependencies: it asks for torch>=2.6.0, which NGC's pre-release
# torch builds (2.6.0a0+...) do not satisfy, so pip would replace the image's torch (and
# the apex and Transformer Engine built against it) with a PyPI one. Its other two
# dependencies, numpy and packaging, are installed here.
RUN grep -v '^megatron-core' requirements.txt > /tmp/requirements-base.txt \
 && pip install --no-cache-dir -r /tmp/requirements-base.txt "packaging>=24.2" \
 && pip install --no-cache-dir --no-deps "$(grep -o '^megatron-core==[^ ]*' requirements.txt)" \
 && python -c "import torch, megatron.core; print('torch', torch.__version__)"
COPY . .
RUN python setup.py -q build_ext --inplace

ENV MEGATRON_SYSX_CACHE=/workspace/cache
CMD ["python", "pretrain_llama.py", "--help"]
