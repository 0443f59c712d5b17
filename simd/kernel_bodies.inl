// Every kernel body, in the order they build on each other, then the table: what each ISA translation unit
// includes inside its own namespace after defining V (the operations adam_body.inl lists).
#include "simd/adam_body.inl"
#include "simd/q8_body.inl"
#include "simd/rule_run.inl"
#include "simd/lion_body.inl"
#include "simd/adagrad_body.inl"
#include "simd/amsgrad_body.inl"
#include "simd/kernel_table.inl"
