# Sourced by the scripts: the tools scripts/setup installed, and nvcc where the CUDA toolkit is.
export PATH="$PWD/.venv/bin:$PATH"
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="$PATH:/usr/local/cuda/bin"
fi
