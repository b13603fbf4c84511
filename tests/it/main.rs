//! The integration tests in one binary (one link per build instead of one per file).

mod checkpoint;
mod collectives;
#[path = "../common/mod.rs"]
mod common;
mod dcp;
mod dcp_forms;
mod dcp_live;
mod dcp_sources;
mod dcp_zstd_stream;
mod deepspeed;
mod error_paths;
mod fsdp2_comm;
mod fsdp2_layout;
mod fsdp2_state_dict_golden;
mod golden_fsdp;
mod hf;
mod layering;
mod megatron;
mod optim_parity;
mod optim_state_scenarios;
mod roundtrip_props;
mod sharded_load;
mod state_dict;
mod tcp_store;
mod torch_load;
mod torch_save;
