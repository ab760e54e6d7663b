# `cmake --install` puts the libraries, their public headers and a CMake package in a prefix, so
# that a C++ trainer's project finds ckpt with find_package(ckpt CONFIG) and links ckpt::ckpt and
# ckpt::optimizer (tests/install checks it against an installed tree). Benchmark internals
# (ckpt/bench) and private headers are not installed.
include(CMakePackageConfigHelpers)
include(GNUInstallDirs)

set(CKPT_INSTALL_TARGETS ckpt_base ckpt_formats ckpt ckpt_optimizer)
if(TARGET ckpt_mpi)
  list(APPEND CKPT_INSTALL_TARGETS ckpt_mpi)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/libckpt/mpi/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endif()
if(TARGET ckpt_optimizer_cuda)
  set_target_properties(ckpt_optimizer_cuda PROPERTIES EXPORT_NAME optimizer_cuda)
  list(APPEND CKPT_INSTALL_TARGETS ckpt_optimizer_cuda)
endif()
install(TARGETS ${CKPT_INSTALL_TARGETS} EXPORT ckptTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(module formats libckpt optimizer)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${module}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endforeach()
install(EXPORT ckptTargets NAMESPACE ckpt:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ckpt)
set(CKPT_INSTALLED_WITH_CUDA ${CKPT_HAVE_CUDA})
set(CKPT_INSTALLED_WITH_MPI ${CKPT_HAVE_MPI})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ckptConfig.cmake.in
                              ${CMAKE_BINARY_DIR}/ckptConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ckpt)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/ckptConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/ckptConfig.cmake ${CMAKE_BINARY_DIR}/ckptConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ckpt)
