# Warning flags shared by every target of ours: ckpt_set_warnings(target).
function(ckpt_set_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow
                         -Wnon-virtual-dtor -Wcast-align -Wunused -Woverloaded-virtual
                         -Wimplicit-fallthrough)
  if(CKPT_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()

# Library code (libckpt, formats, optimizer) builds without exceptions (STYLE.md §2).
function(ckpt_library_flags target)
  ckpt_set_warnings(${target})
  target_compile_options(${target} PRIVATE -fno-exceptions)
endfunction()
