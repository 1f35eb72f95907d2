python3 -m pytest -q -n 14 -m gpu -p no:benchmark tests/kernels/test_fwd_gpu.py tests/test_autograd.py tests/kernels/test_gallery_matrix_gpu.py tests/gallery/test_variants_gpu.py 2>&1 | tail -3
python3 -m pytest -q -n 8 -m gpu -p no:benchmark tests/kernels/test_bwd_gpu.py 2>&1 | tail -3
timeout 240 compute-sanitizer --tool memcheck --report-api-errors no python3 tests/kernels/bwd_memcheck.py --no-gallery --head-dims 64,128 2>&1 | tail -6
