# CKPT_MPI: AUTO builds ckpt::mpi (MpiCoordinator) when find_package(MPI) finds a C MPI (Debian:
# libopenmpi-dev); ON requires it; OFF never looks. Sets CKPT_HAVE_MPI.
set(CKPT_MPI AUTO CACHE STRING "Build the MPI coordinator: AUTO, ON or OFF")
set_property(CACHE CKPT_MPI PROPERTY STRINGS AUTO ON OFF)
set(CKPT_HAVE_MPI OFF)
if(NOT CKPT_MPI STREQUAL "OFF")
  find_package(MPI QUIET COMPONENTS C)
  if(MPI_C_FOUND)
    set(CKPT_HAVE_MPI ON)
  elseif(CKPT_MPI STREQUAL "ON")
    message(FATAL_ERROR "CKPT_MPI=ON but no MPI was found (Debian: apt-get install libopenmpi-dev)")
  endif()
endif()
message(STATUS "ckpt: MPI coordinator ${CKPT_HAVE_MPI} (CKPT_MPI=${CKPT_MPI})")
