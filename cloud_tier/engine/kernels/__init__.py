"""Native kernels, compiled on first use with the machine's compiler (torch's cpp_extension),
with a pure-torch fallback when that is not possible."""
