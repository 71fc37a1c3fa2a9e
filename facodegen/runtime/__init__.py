"""From source to a launch: NVRTC and the compile cache, the CUDA driver, TMA maps, the kernels'
argument structs, launch geometry and the plans that make a repeated call cheap."""
