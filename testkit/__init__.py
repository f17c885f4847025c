"""Helpers the tests and the benchmarks share (throwaway servers, a load generator); the library never imports them."""
