"""Shared model layers, each owning its kernel call: norm (RMSNorm, fused residual add), linear
(merged row blocks), activation + mlp (SwiGLU), rotary (RoPE), attention (the layer that calls the
attention backend) and gdn (Gated DeltaNet linear attention). Tensors are flattened over the step's
tokens: [T, ...].

On CUDA (`fused.use_fused_kernels`) the elementwise work runs in Triton kernels that round like the
torch ops here; elsewhere (the CPU, where the transformers-parity tests run) the torch code runs."""
