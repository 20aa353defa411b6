#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| tutti_runtime::fuzzing::shm_ring(data));
