"""Developer tools, imported only by the tests and the benchmarks (never by the library):
deviceless chip compiles (`compile_check`) and the bytes a compiled program moves across
devices (`collectives`)."""
