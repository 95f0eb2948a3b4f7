# Warnings and sanitizers shared by every strata target.
add_library(strata_compile_options INTERFACE)
target_compile_options(strata_compile_options INTERFACE
  $<$<COMPILE_LANGUAGE:CXX,C>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
  -Wno-missing-field-initializers>)

if(STRATA_SANITIZE)
  add_compile_options(-fsanitize=${STRATA_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_link_options(-fsanitize=${STRATA_SANITIZE})
endif()

# Builds one strata layer: a static library with public headers under include/ and an alias
# strata::<name>.
function(strata_add_layer name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(strata_${name} ${ARG_SOURCES})
  add_library(strata::${name} ALIAS strata_${name})
  set_target_properties(strata_${name} PROPERTIES EXPORT_NAME ${name} OUTPUT_NAME strata_${name})
  target_include_directories(strata_${name} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_compile_features(strata_${name} PUBLIC cxx_std_20)
  target_link_libraries(strata_${name} PUBLIC ${ARG_PUBLIC_DEPS}
    PRIVATE ${ARG_PRIVATE_DEPS} $<BUILD_INTERFACE:strata_compile_options>)
  if(NOT SKBUILD)  # a wheel carries the Python package only
    install(TARGETS strata_${name} EXPORT strataTargets
      ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
      LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
    install(DIRECTORY include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  endif()
endfunction()
