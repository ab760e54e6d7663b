# Module boundaries (DESIGN.md §1, STYLE.md §1). Each module exposes only include/ckpt/... as
# PUBLIC include directories. Its private headers are included by their path from the
# repository root ("libckpt/read_pipeline.h"), but the repository root is never an include
# directory: each target gets a private root of its own holding a link to its module's folder
# only, so `#include "libckpt/..."` from formats/, cli/ or demo/ does not compile.
# tests/layering_check.cmake checks the same rules over every file, tests included.

# ckpt_private_root(target module...): `target` may include the private headers of `module`s.
function(ckpt_private_root target)
  set(root ${CMAKE_BINARY_DIR}/private-roots/${target})
  file(MAKE_DIRECTORY ${root})
  foreach(module ${ARGN})
    if(NOT EXISTS ${root}/${module})
      file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${module} ${root}/${module} SYMBOLIC)
    endif()
  endforeach()
  target_include_directories(${target} PRIVATE ${root})
endfunction()

# ckpt_public_include(target dir): `dir`/include as the target's public headers, in the build
# tree and once installed.
function(ckpt_public_include target dir)
  target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${dir}/include>
                                              $<INSTALL_INTERFACE:include>)
endfunction()
